"""models: shapes, BuggyCNN's two mistakes, pipeline stages."""

import math

import pytest
import torch
from torch import nn

from ddp_course import models


def test_small_cnn_outputs_logits():
    out = models.SmallCNN().eval()(torch.randn(4, 1, 28, 28))
    assert out.shape == (4, 10)
    assert not torch.allclose(out.sum(1), torch.ones(4))  # not probabilities


def test_buggy_cnn_linear_layer_does_not_fit():
    with pytest.raises(RuntimeError, match="cannot be multiplied"):
        models.BuggyCNN()(torch.randn(2, 1, 28, 28))


def test_double_softmax_has_a_loss_floor():
    model = models.BuggyCNN(in_features=None).eval()
    probs = model(torch.randn(2, 1, 28, 28))
    torch.testing.assert_close(probs.sum(1), torch.ones(2))
    perfect = torch.eye(10)
    floor = nn.functional.cross_entropy(perfect, torch.arange(10)).item()
    assert math.isclose(floor, math.log(math.e + 9) - 1, rel_tol=1e-6)


def test_mlp_and_layer_stack_shapes():
    assert models.MLP()(torch.randn(5, 1, 28, 28)).shape == (5, 10)
    stack = models.LayerStack(num_layers=4)
    x = torch.randn(3, 784)
    out = x
    for i in range(3):
        out = stack.stage(i, 3)(out)
    torch.testing.assert_close(out, stack(x))
    with pytest.raises(ValueError):
        stack.stage(3, 3)


def test_resnet18_mnist_takes_one_channel():
    out = models.resnet18_mnist().eval()(torch.randn(2, 1, 28, 28))
    assert out.shape == (2, 10)


def test_tiny_gpt_shapes_and_causality():
    torch.manual_seed(0)
    gpt = models.TinyGPT(vocab_size=32, d_model=16, n_heads=2, n_layers=2, seq_len=8).eval()
    idx = torch.randint(32, (3, 8))
    logits = gpt(idx)
    assert logits.shape == (3, 8, 32)
    # Changing the last token changes no earlier position's logits.
    later = idx.clone()
    later[:, -1] = (later[:, -1] + 1) % 32
    torch.testing.assert_close(gpt(later)[:, :-1], logits[:, :-1])
    assert not torch.allclose(gpt(later)[:, -1], logits[:, -1])
    with pytest.raises(ValueError, match="longer than seq_len"):
        gpt(torch.zeros(1, 9, dtype=torch.long))
    with pytest.raises(ValueError, match="multiple of n_heads"):
        models.TinyGPT(d_model=10, n_heads=4)


def test_tiny_gpt_written_out_attention_equals_the_fused_kernel():
    torch.manual_seed(0)
    fused = models.TinyGPT(d_model=16, n_heads=4, seq_len=8).double()
    written = models.TinyGPT(d_model=16, n_heads=4, seq_len=8, flash=False).double()
    written.load_state_dict(fused.state_dict())
    idx = torch.randint(256, (2, 8))
    torch.testing.assert_close(written(idx), fused(idx), rtol=1e-12, atol=1e-12)


def test_tiny_gpt_same_seed_same_weights_and_gpt2_init():
    torch.manual_seed(3)
    a = models.TinyGPT()
    torch.manual_seed(3)
    b = models.TinyGPT()
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0, msg=name)
    assert abs(a.head.weight.std().item() - 0.02) < 0.002
    assert a.blocks[0].attn.q.bias.abs().max() == 0


def test_lm_loss_is_the_mean_over_every_token():
    logits = torch.randn(2, 3, 5)
    targets = torch.randint(5, (2, 3))
    per_token = -logits.log_softmax(-1).gather(-1, targets[..., None]).squeeze(-1)
    torch.testing.assert_close(models.lm_loss(logits, targets), per_token.mean())


@pytest.mark.parametrize("flash", [False, True])
def test_attention_core_is_the_part_of_forward_between_the_projections(flash):
    torch.manual_seed(0)
    attn = models.CausalSelfAttention(16, 4, flash=flash).eval()
    x = torch.randn(2, 8, 16)
    heads = [lin(x).view(2, 8, 4, 4).transpose(1, 2) for lin in (attn.q, attn.k, attn.v)]
    y = attn.attention_core(*heads)
    assert y.shape == (2, 4, 8, 4)
    torch.testing.assert_close(attn.proj(y.transpose(1, 2).reshape(2, 8, 16)), attn(x))
    attn.attention_core = lambda q, k, v: torch.zeros_like(q)  # forward calls it, by name
    torch.testing.assert_close(attn(x), attn.proj.bias.expand(2, 8, 16))
