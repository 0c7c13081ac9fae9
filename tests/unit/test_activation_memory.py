"""ddp_course.activation_memory: saved bytes measured with hooks against the per-term
prediction (float32 and bfloat16, several shapes), Korthikanti's formula, the optimizer
state counted exactly, and fit_micro_batch's choice checked by measurement."""

import pytest
import torch

from ddp_course import activation_checkpoint as ac
from ddp_course import activation_memory as am
from ddp_course.models import Block, TinyGPT, lm_loss

D, HEADS = 32, 4


def measured_block(batch, seq, dropout, flash=False, dtype=torch.float32):
    torch.manual_seed(0)
    block = Block(D, HEADS, dropout, flash).to(dtype).train()
    x = torch.randn(batch, seq, D, dtype=dtype, requires_grad=True)
    with am.SavedTensorCounter(block.parameters()) as saved:
        block(x)
    return saved


@pytest.mark.parametrize("batch,seq", [(1, 8), (2, 16), (3, 32), (4, 64)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_block_bytes_match_the_terms_exactly(batch, seq, dtype):
    e = torch.finfo(dtype).bits // 8
    saved = measured_block(batch, seq, 0.1, dtype=dtype)
    assert saved.activation_bytes == am.block_bytes(batch, seq, D, HEADS, element_bytes=e)


@pytest.mark.parametrize("seq", [16, 24, 64])  # not head_dim (8): [s, s] is unambiguous
def test_block_without_dropout_and_fused_attention(seq):
    plain = measured_block(2, seq, 0.0)
    assert plain.activation_bytes == am.block_bytes(2, seq, D, HEADS, dropout=False)
    fused = measured_block(2, seq, 0.0, flash=True)
    assert fused.activation_bytes == am.block_bytes(2, seq, D, HEADS, dropout=False, flash=True)
    # The fused kernel keeps no [s, s] tensor: its bytes grow linearly with s.
    shapes = [s for s, _, _, kind in fused.saved if kind == "activation"]
    assert not any(shape[-2:] == (seq, seq) for shape in shapes)
    assert any(s[-2:] == (seq, seq) for s, _, _, k in plain.saved if k == "activation")


def test_views_counted_once_and_parameters_apart():
    w = torch.nn.Parameter(torch.randn(8, 8))
    x = torch.randn(4, 8, requires_grad=True)
    with am.SavedTensorCounter([w]) as once:
        y = x * 2
        (y.view(2, 16) * y.view(2, 16)).sum()  # saves two views of y's storage
        x @ w  # saves x and w
    assert once.activation_bytes == 2 * 4 * 8 * 4  # y and x, once each
    assert once.parameter_bytes == 8 * 8 * 4
    with am.SavedTensorCounter([w], count_views_once=False) as twice:
        y = x * 2
        (y.view(2, 16) * y.view(2, 16)).sum()
        x @ w
    assert twice.activation_bytes == 3 * 4 * 8 * 4


def test_korthikanti_formula_is_the_sum_of_its_terms():
    # 16-bit, 1-byte masks: the paper's 34 sbh + 5 a s^2 b, plus the terms it leaves out.
    for b, s in [(1, 128), (4, 512)]:
        terms = am.block_terms(b, s, 1024, 16, element_bytes=2, mask_bytes=1)
        small = sum(t.bytes for t in terms if "mean" in t.name or t.name == "causal mask")
        assert sum(t.bytes for t in terms) - small == am.korthikanti_block_bytes(s, b, 1024, 16)


CFG = {"d_model": D, "n_heads": HEADS, "n_layers": 3, "seq_len": 32, "dropout": 0.1,
       "flash": False}  # fmt: skip


def held_bytes(cfg, batch, seq, policy):
    torch.manual_seed(0)
    model = TinyGPT(**cfg)
    record = ac.apply_policy(model, policy)
    g = torch.Generator().manual_seed(1)
    x, y = (torch.randint(0, 256, (batch, seq), generator=g) for _ in range(2))
    with am.SavedTensorCounter(model.parameters()) as saved:
        lm_loss(model(x), y)
    return saved.activation_bytes + record.saved_bytes


@pytest.mark.parametrize("policy", am.POLICIES)
@pytest.mark.parametrize("batch,seq", [(2, 16), (3, 32)])
def test_whole_model_per_policy(policy, batch, seq):
    predicted = am.predict_activations(CFG, batch, seq, policy)["held"]
    assert held_bytes(CFG, batch, seq, policy) == predicted


def test_state_bytes_exact_after_an_adamw_step():
    model = TinyGPT(d_model=D, n_heads=HEADS, n_layers=1, seq_len=16)
    opt = torch.optim.AdamW(model.parameters())
    x = torch.randint(0, 256, (2, 16))
    lm_loss(model(x), x).backward()
    opt.step()
    nbytes = sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values())
    grads = sum(p.grad.numel() * p.grad.element_size() for p in model.parameters())
    assert am.state_bytes(model) == {
        "parameters": sum(p.numel() * 4 for p in model.parameters()),
        "gradients": grads,
        "optimizer": nbytes,
    }


def measured_step(cfg, batch, seq, policy):
    """State bytes (exact), held activations (hooks) and the recompute region (hooks)."""
    with torch.device("meta"):
        state = am.state_bytes(TinyGPT(**cfg))
    held = held_bytes(cfg, batch, seq, policy)
    region = 0
    if policy != "none":
        block = Block(cfg["d_model"], cfg["n_heads"], cfg["dropout"], cfg["flash"])
        x = torch.randn(batch, seq, cfg["d_model"], requires_grad=True)
        with am.SavedTensorCounter(block.parameters()) as saved:
            block(x)
        region = saved.activation_bytes
    return sum(state.values()) + held + region + 4 * batch * seq * 256


def test_fit_micro_batch_fits_and_one_more_does_not():
    budget = 3_000_000
    policy, batch, step = am.fit_micro_batch(CFG, budget, 32)
    assert step.total <= budget
    assert am.predict_step(CFG, batch + 1, 32, policy).total > budget
    assert measured_step(CFG, batch, 32, policy) == step.total <= budget
    assert measured_step(CFG, batch + 1, 32, policy) > budget
    # Without checkpointing the same budget holds fewer samples.
    _, plain, _ = am.fit_micro_batch(CFG, budget, 32, policies=("none",))
    assert plain < batch


def test_bad_input_raises_clearly():
    with pytest.raises(ValueError, match="multiple of n_heads"):
        am.block_terms(2, 8, 30, 4)
    with pytest.raises(ValueError, match="flash=False"):
        am.block_terms(2, 8, 32, 4, flash=True, dropout=True)
    with pytest.raises(ValueError, match="policy must be"):
        am.predict_activations(CFG, 2, 8, "sometimes")
    with pytest.raises(ValueError, match="longer than"):
        am.predict_activations(CFG, 2, 64)
    with pytest.raises(ValueError, match="budget"):
        am.fit_micro_batch(CFG, 1000, 32)
