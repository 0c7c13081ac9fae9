"""The one-process MoE: capacity (Switch Transformer eq. 3), top-k routing with GShard's
priority, the load-balancing loss (Switch eq. 4) and the layer, each against a loop written
out token by token; bad input refused with a clear error. GShard's capacity-padded dispatch
on a group of one against the layer, and the row counts of the padded and dropless exchanges.
Several ranks: tests/scripts/test_lesson15.py (scripts/15_moe.py at 4 ranks, EP x DP).
"""

import contextlib
import gc
import math

import pytest
import torch
import torch.distributed as dist

from ddp_course import expert_data_parallel as epdp
from ddp_course import expert_parallel as ep
from ddp_course import expert_parallel_dropless as dropless
from ddp_course.models import FeedForward

D, HIDDEN = 6, 10


def test_capacity_is_the_ceiling_of_factor_tokens_k_over_experts():
    assert ep.capacity(12, 4, 1, 1.0) == 3
    assert ep.capacity(12, 4, 2, 1.0) == 6
    assert ep.capacity(10, 4, 1, 1.25) == 4  # 3.125 rounds up
    assert ep.capacity(0, 4, 1, 1.0) == 0
    with pytest.raises(ValueError, match="1 <= k <= num_experts"):
        ep.capacity(8, 4, 5, 1.0)
    with pytest.raises(ValueError, match="capacity_factor > 0"):
        ep.capacity(8, 4, 1, 0.0)


def test_route_drops_in_gshard_order_first_choices_before_second():
    # 4 tokens, 2 experts, top-2, capacity ceil(0.5 * 4 * 2 / 2) = 2 slots per expert.
    logits = torch.tensor([[2.0, 0.0], [1.0, 0.0], [0.0, 1.0], [3.0, 0.0]])
    r = ep.route(logits, k=2, capacity_factor=0.5)
    assert r.capacity == 2
    assert r.experts.tolist() == [[0, 1], [0, 1], [1, 0], [0, 1]]
    # First choices: expert 0 gets tokens 0, 1 and 3 -> token 3 dropped; expert 1 gets
    # token 2. Second choices: expert 1 has one slot left (token 0), expert 0 none.
    assert r.keep.tolist() == [[True, True], [True, False], [True, False], [False, False]]
    assert r.slot.tolist() == [[0, 1], [1, 2], [0, 3], [2, 3]]  # places in GShard's order
    assert r.routed.tolist() == [4, 4]
    assert r.kept.tolist() == [2, 2]
    assert r.dropped == 4


def test_gates_renormalised_for_top2_raw_for_top1():
    logits = torch.randn(5, 4, generator=torch.Generator().manual_seed(0))
    probs = torch.softmax(logits, -1)
    top1 = ep.route(logits, k=1, capacity_factor=10.0)
    torch.testing.assert_close(top1.gates[:, 0], probs.max(-1).values)
    top2 = ep.route(logits, k=2, capacity_factor=10.0)
    torch.testing.assert_close(top2.gates.sum(-1), torch.ones(5))
    raw = ep.route(logits, k=2, capacity_factor=10.0, normalize=False)
    assert (raw.gates.sum(-1) < 1).all()


def test_aux_loss_is_switch_eq4_counted_token_by_token():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(16, 4, generator=gen, dtype=torch.float64)
    r = ep.route(logits, k=2, capacity_factor=1.0)
    probs = torch.softmax(logits, -1)
    counts = [0] * 4
    for t in range(16):
        for e in sorted(range(4), key=lambda e: -probs[t, e])[:2]:
            counts[e] += 1
    expected = 4 * sum(counts[i] / 32 * probs[:, i].mean() for i in range(4))
    torch.testing.assert_close(r.aux_loss, expected, rtol=1e-12, atol=1e-12)
    # A router that gives every expert the same share has the loss's minimum, 1.
    even = torch.tensor([[5.0, 0, 0, 0], [0, 5.0, 0, 0], [0, 0, 5.0, 0], [0, 0, 0, 5.0]])
    assert ep.route(even, k=1, capacity_factor=1.0).aux_loss.item() == pytest.approx(1.0)
    skewed = torch.tensor([[5.0, 0, 0, 0]] * 4)
    assert ep.route(skewed, k=1, capacity_factor=1.0).aux_loss.item() > 3


def moe(k=2, capacity_factor=1.0, experts=4):
    torch.manual_seed(0)
    return ep.MoE(D, HIDDEN, experts, k, capacity_factor).double()


def by_hand(layer, x, groups=1):
    """The layer's output token by token: a loop over groups, tokens and choices."""
    out = torch.zeros_like(x)
    n = x.shape[0] // groups
    for g in range(groups):
        probs = torch.softmax(layer.router(x[g * n : (g + 1) * n]), -1)
        cap = math.ceil(layer.capacity_factor * n * layer.k / layer.num_experts)
        used = [0] * layer.num_experts
        top = probs.topk(layer.k, -1)
        gates = top.values / top.values.sum(-1, keepdim=True) if layer.k > 1 else top.values
        for j in range(layer.k):
            for t in range(n):
                e = int(top.indices[t, j])
                used[e] += 1
                if used[e] <= cap:
                    token = g * n + t
                    out[token] += gates[t, j] * layer.experts[e](x[token])
    return out


@pytest.mark.parametrize("k, factor, groups", [(1, 1.0, 1), (2, 1.0, 1), (2, 0.75, 2), (2, 9, 3)])
def test_moe_equals_the_loop_token_by_token(k, factor, groups):
    layer = moe(k, factor)
    x = torch.randn(12, D, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    y, routings = layer(x, groups=groups)
    torch.testing.assert_close(y, by_hand(layer, x, groups), rtol=1e-12, atol=1e-12)
    assert len(routings) == groups
    if factor < 1:
        assert sum(r.dropped for r in routings) > 0


def dropless_by_hand(layer, x):
    """Every token through each of its k experts, weighted by its gates: no capacity at all."""
    probs = torch.softmax(layer.router(x), -1)
    top = probs.topk(layer.k, -1)
    gates = top.values / top.values.sum(-1, keepdim=True) if layer.k > 1 else top.values
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(layer.k):
            out[t] += gates[t, j] * layer.experts[int(top.indices[t, j])](x[t])
    return out


@pytest.mark.parametrize("k", [1, 2])
def test_an_infinite_capacity_factor_drops_nothing(k):
    assert ep.capacity(12, 4, k, float("inf")) == 12  # at most one slot per token per expert
    assert ep.capacity(0, 4, k, float("inf")) == 0
    with pytest.raises(ValueError, match="capacity_factor > 0"):
        ep.capacity(8, 4, 1, float("nan"))
    layer = moe(k, float("inf"))
    x = torch.randn(12, D, dtype=torch.float64, generator=torch.Generator().manual_seed(2)) + 2
    with torch.no_grad():  # the worst case: every token's first choice is expert 0
        layer.router.weight[0] += 5.0
    for groups in (1, 3):
        y, routings = layer(x, groups=groups)
        assert all(r.dropped == 0 and torch.equal(r.kept, r.routed) for r in routings)
        torch.testing.assert_close(y, dropless_by_hand(layer, x), rtol=1e-12, atol=1e-12)
    (r,) = layer(x)[1]
    assert r.routed[0] == 12 and r.capacity == 12  # everyone on expert 0, all kept
    # A finite factor, however large the imbalance it allows, drops here; infinity does not.
    assert moe(k, 1.0)(x)[1][0].dropped > 0


def test_a_token_with_every_choice_dropped_gets_zero():
    layer = moe(k=1, capacity_factor=0.25)  # capacity 1 for 4 tokens and 4 experts
    with torch.no_grad():
        layer.router.weight.zero_()
        layer.router.weight[0, 0] = 1.0  # every token prefers expert 0
    x = torch.ones(4, D, dtype=torch.float64)
    y, (r,) = layer(x)
    assert r.kept.tolist() == [1, 0, 0, 0] and r.dropped == 3
    assert y[0].abs().sum() > 0 and torch.equal(y[1:], torch.zeros(3, D, dtype=torch.float64))


def test_batch_time_input_is_flattened_row_major():
    layer = moe()
    x = torch.randn(2, 6, D, dtype=torch.float64)
    y, _ = layer(x)
    assert y.shape == x.shape
    torch.testing.assert_close(y.reshape(12, D), layer(x.reshape(12, D))[0])


def test_bad_input_gets_a_clear_error():
    with pytest.raises(ValueError, match=r"num_experts=6 is not divisible by world_size=4"):
        ep.experts_of_rank(6, 4, 0)
    assert list(ep.experts_of_rank(8, 4, 1)) == [2, 3]
    with pytest.raises(ValueError, match=r"num_experts=6 is not divisible"):
        ep.ExpertParallelMoE(moe(experts=6), 0, 4)
    with pytest.raises(ValueError, match=r"expected \[tokens, 6\]"):
        moe()(torch.randn(3, 5, dtype=torch.float64))
    with pytest.raises(ValueError, match="groups=5 must divide the 12 tokens"):
        moe()(torch.randn(12, D, dtype=torch.float64), groups=5)
    # Two ranks' worth of experts but no process group: say how to get one, do not hang.
    with pytest.raises(RuntimeError, match="torchrun"):
        ep.ExpertParallelMoE(moe(), 0, 2)(torch.randn(4, D, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="torchrun"):
        ep.all_to_all(torch.randn(3, D), [3], [3])


@contextlib.contextmanager
def group_of_one():
    """A gloo group of one rank for the length of one test (other tests here need none)."""
    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        gc.collect()
        dist.destroy_process_group()


@pytest.mark.parametrize("factor", [1.0, float("inf")])
def test_padded_dispatch_equals_the_layer_and_sends_every_slot(factor):
    layer = moe(2, factor)
    x = torch.randn(12, D, dtype=torch.float64, generator=torch.Generator().manual_seed(2)) + 1
    with torch.no_grad():  # every token's first choice: expert 0
        layer.router.weight[0] += 2.0
    x_ref = x.clone().requires_grad_()
    y_ref, (r,) = layer(x_ref)
    y_ref.square().sum().backward()
    with group_of_one():
        padded = dropless.PaddedExpertParallelMoE(layer, 0, 1)
        x_pad = x.clone().requires_grad_()
        y, routing, splits = padded(x_pad)
        y.square().sum().backward()
    torch.testing.assert_close(y, y_ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(x_pad.grad, x_ref.grad, rtol=1e-12, atol=1e-12)
    for a, b in zip(padded.parameters(), layer.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-12, atol=1e-12)
    assert splits["send"] == [4 * routing.capacity]  # every expert's slots, full or not
    assert routing.capacity == (6 if factor == 1.0 else 12)
    assert (routing.dropped > 0) == (factor == 1.0)


def test_rows_each_exchange_sends_to_other_ranks():
    # 4 experts on 2 ranks (0, 1 on rank 0; 2, 3 on rank 1), top-2, no capacity.
    logits = torch.tensor([[3.0, 2, 0, 0], [0, 3, 2, 0], [0, 0, 3, 2], [2, 0, 0, 3]])
    r = ep.route(logits, k=2, capacity_factor=float("inf"))
    assert r.experts.tolist() == [[0, 1], [1, 2], [2, 3], [3, 0]]
    assert dropless.routed_rows_to_others(r, rank=0, world_size=2) == 4  # 2, 2, 3, 3
    assert dropless.routed_rows_to_others(r, rank=1, world_size=2) == 4  # 0, 1, 1, 0
    assert dropless.routed_rows_to_others(r, rank=0, world_size=1) == 0
    # Padded: the other rank's 2 experts x capacity rows, whatever the routing.
    assert dropless.padded_rows_to_others(r.capacity, 4, 2) == 2 * 4
    assert dropless.padded_rows_to_others(3, 8, 4) == 3 * 2 * 3


def test_expert_data_parallel_mesh_needs_ep_to_divide_the_world():
    with pytest.raises(ValueError, match="ep_size=3 must divide world_size=4"):
        epdp.expert_data_parallel_mesh("cpu", 4, 3)


def test_the_dropless_split_sizes_reach_the_host_before_the_rows_travel(monkeypatch):
    """The uneven exchange copies its split sizes to Python ints (on a GPU: a host sync)
    between the all-to-all of counts and the one of rows; the padded exchange never does."""
    events = []
    tolist, all_to_all_single = torch.Tensor.tolist, dist.all_to_all_single

    def logged_tolist(t):
        events.append("tolist")
        return tolist(t)

    def logged_all_to_all(out, inp, *args, **kwargs):
        events.append(f"all_to_all {inp.dtype}")
        return all_to_all_single(out, inp, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "tolist", logged_tolist)
    monkeypatch.setattr(dist, "all_to_all_single", logged_all_to_all)
    x = torch.randn(12, D, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    seen = {}
    with group_of_one():
        for layer in (ep.ExpertParallelMoE, dropless.PaddedExpertParallelMoE):
            events.clear()
            layer(moe(2, float("inf")), 0, 1)(x)
            seen[layer] = list(events)
    assert seen[ep.ExpertParallelMoE] == [
        "all_to_all torch.int64",
        "tolist",
        "tolist",
        "all_to_all torch.float64",
        "all_to_all torch.float64",
    ]
    assert seen[dropless.PaddedExpertParallelMoE] == ["all_to_all torch.float64"] * 2


def test_a_shared_expert_adds_its_output_to_every_token_dropped_or_not():
    layer = moe(k=1, capacity_factor=0.25)  # capacity 1 of 4 tokens: three dropped
    with torch.no_grad():
        layer.router.weight.zero_()
        layer.router.weight[0, 0] = 1.0
    shared = FeedForward(D, HIDDEN).double()
    x = torch.ones(4, D, dtype=torch.float64)
    y, (r,) = ep.SharedExpertMoE(layer, shared)(x)
    assert r.dropped == 3
    torch.testing.assert_close(y, layer(x)[0] + shared(x), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(y[1:], shared(x[1:]), rtol=1e-12, atol=1e-12)  # dropped tokens
