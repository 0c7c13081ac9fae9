"""Context parallelism's model-level pieces in one process (a gloo group of one): TinyGPT's
positions, ContextParallelGPT against TinyGPT, the bytes ring attention saves for backward,
and the alpha-beta times of ring attention and Ulysses with their crossover.

More ranks: scripts/15_context_parallel.py's TinyGPT check (tests/scripts/test_lesson15.py
at 1 and 2 ranks, notebook 15 at 4), with its three mistakes.
"""

import pytest
import torch

from ddp_course import context_parallel as cp
from ddp_course.models import TinyGPT, lm_loss
from ddp_course.tools.saved_tensors import SavedTensorCounter

GPT = {"vocab_size": 32, "d_model": 16, "n_heads": 2, "n_layers": 2, "seq_len": 16}


def tiny(**kw):
    torch.manual_seed(0)
    return TinyGPT(**{**GPT, **kw}).double()


def tokens(t=16):
    return torch.randint(GPT["vocab_size"], (2, t + 1), generator=torch.Generator().manual_seed(1))


def test_tinygpt_positions_default_to_the_first_ones_and_are_checked():
    model, idx = tiny(), tokens(8)[:, :-1]
    torch.testing.assert_close(model(idx, positions=torch.arange(8)), model(idx), rtol=0, atol=0)
    assert not torch.allclose(model(idx, positions=torch.arange(8, 16)), model(idx))
    with pytest.raises(ValueError, match="below seq_len=16"):
        model(idx, positions=torch.arange(9, 17))
    with pytest.raises(ValueError, match="positions must be 8 values"):
        model(idx, positions=torch.arange(4))


def test_context_parallel_gpt_on_one_rank_equals_tinygpt(group):
    ref, model, idx = tiny(), tiny(), tokens()
    gpt = cp.ContextParallelGPT(model, layout="zigzag")
    assert gpt.positions(16).tolist() == list(range(16))  # one rank holds the whole sequence
    loss = cp.context_parallel_loss(gpt(idx[:, :-1]), idx[:, 1:])
    loss.backward()
    cp.reduce_gradients(model)
    expected = lm_loss(ref(idx[:, :-1]), idx[:, 1:])
    expected.backward()
    torch.testing.assert_close(loss, expected, rtol=1e-12, atol=1e-12)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-12, msg=name)
    assert all(isinstance(b.attn.attention_core, cp.ContextParallelCore) for b in model.blocks)


def test_context_parallel_gpt_refuses_dropout():
    with pytest.raises(ValueError, match="no dropout"):
        cp.ContextParallelGPT(tiny(dropout=0.1))


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_ring_saved_bytes_is_what_autograd_keeps(group, dtype):
    q, k, v = (torch.randn(2, 3, 8, 4, dtype=dtype).requires_grad_() for _ in range(3))
    with SavedTensorCounter() as saved:
        cp.ring_attention(q, k, v)
    acc = cp.accumulator_dtype(dtype).itemsize  # float32 output and lse for bfloat16
    assert saved.activation_bytes == cp.ring_saved_bytes(q.shape, dtype.itemsize, acc)
    assert [s[0] for s in saved.saved] == [(2, 3, 8, 4)] * 4 + [(2, 3, 8)]


def test_ring_against_ulysses_crossover():
    alpha, beta = 2e-4, 1 / 2e9
    for p in (2, 3, 4, 8, 64):
        s = cp.ring_ulysses_crossover(p, alpha, beta)
        ring, uly = cp.ring_comm_time(s, p, alpha, beta), cp.ulysses_comm_time(s, p, alpha, beta)
        assert ring == pytest.approx(uly, rel=1e-12)
        # Below it the ring's fewer latencies win, above it Ulysses' fewer bytes.
        assert cp.ring_comm_time(s / 2, p, alpha, beta) < cp.ulysses_comm_time(
            s / 2, p, alpha, beta
        )
        assert cp.ring_comm_time(2 * s, p, alpha, beta) > cp.ulysses_comm_time(
            2 * s, p, alpha, beta
        )
        assert 5 / 6 * alpha / beta <= s <= 27 / 26 * alpha / beta * (1 + 1e-12)  # largest at P = 3
    assert cp.ring_ulysses_crossover(2, alpha, beta) == pytest.approx(alpha / beta)
    # The byte terms are the counted chunks: 6P - 4 for the ring, 8(P-1)/P for Ulysses.
    assert cp.ring_comm_time(1.0, 4, 0.0, 1.0) == 2 * (3 * 4 - 2) == 6 * 4 - 4
    assert cp.ulysses_comm_time(1.0, 4, 0.0, 1.0) == 8 * 3 / 4
    assert cp.ring_comm_time(1.0, 1, alpha, beta) == cp.ulysses_comm_time(1.0, 1, alpha, beta) == 0
    with pytest.raises(ValueError, match="2 ranks or more"):
        cp.ring_ulysses_crossover(1, alpha, beta)
