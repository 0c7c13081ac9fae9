"""FSDP from scratch as a module wrapper (``ddp_course.fsdp``) in one process: the shards
against ``torch.chunk`` and ``fully_shard``'s, the collectives of a step against the formula
and ``fully_shard``'s, and where the full weights live, on 4 fake ranks (a fake process
group: shapes and calls are real, values are not); training against plain SGD, AdamW and
bfloat16 casts, frozen and tied parameters, on a group of one rank. The numbers at 2 real
ranks: tests/multiprocess/test_fsdp.py."""

import contextlib
import copy
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn

from ddp_course.fsdp import FSDP, unit_numel
from ddp_course.partition import partition
from ddp_course.runtime import distributed
from ddp_course.tools.collective_log import CollectiveLog

warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")


@contextlib.contextmanager
def fake_ranks(rank, world_size=4):
    fake_pg = pytest.importorskip("torch.testing._internal.distributed.fake_pg")
    dist.init_process_group("fake", store=fake_pg.FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def make(dtype=torch.float64):
    # Rows 5, 3 and 1 over 4 ranks: 2+2+1+0, 1+1+1+0, 1+0+0+0 (shards empty on some ranks).
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3), nn.Tanh(), nn.Linear(3, 1)
    ).to(dtype)


def wrap(net, **kwargs):
    return FSDP(net, units=[net[0], net[2]], sync_module_states=False, **kwargs)


@pytest.mark.parametrize("rank", [0, 3])
def test_shards_are_the_rows_fully_shard_keeps(rank):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    with fake_ranks(rank):
        full = make()
        model = wrap(copy.deepcopy(full))
        theirs = copy.deepcopy(full)
        for unit in (theirs[0], theirs[2], theirs):
            fully_shard(unit, mesh=init_device_mesh("cpu", (4,)))
        shards = dict(model.module.named_parameters())
        for (name, p), (_, dt) in zip(full.named_parameters(), theirs.named_parameters()):
            shard = shards[name]
            assert type(shard) is nn.Parameter  # a plain tensor, no DTensor
            chunks = list(torch.chunk(p.detach(), 4)) + [p.detach()[:0]] * 4  # missing: empty
            torch.testing.assert_close(shard.detach(), chunks[rank], rtol=0, atol=0)
            torch.testing.assert_close(shard.detach(), dt.to_local(), rtol=0, atol=0)
            assert model.row_ranges()[name] == partition(p.shape[0], 4, "padded")[rank]
    # The optimizer sees the shards: AdamW's state is of the shard's size.
    assert [tuple(s.shape) for s in shards.values()] == (
        [(2, 6), (2,), (1, 5), (1,), (1, 3), (1,)]
        if rank == 0
        else [(0, 6), (0,), (0, 5), (0,), (0, 3), (0,)]
    )


def one_step(model, x):
    log = CollectiveLog()
    with log.recording("step"):
        model(x).float().square().mean().backward()
    return sorted((c["op"], c["bytes"], c["dtype"]) for c in log.calls)


@pytest.mark.parametrize("reshard", [True, False])
@pytest.mark.parametrize("compute_dtype", [None, torch.bfloat16])
def test_a_step_calls_what_the_formula_and_fully_shard_call(reshard, compute_dtype):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    x = torch.randn(4, 6)
    with fake_ranks(1):
        model = wrap(
            make(torch.float32), reshard_after_forward=reshard, compute_dtype=compute_dtype
        )
        mine = one_step(model, x)
        theirs = make(torch.float32)
        policy = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
        mesh = init_device_mesh("cpu", (4,))
        for unit in (theirs[0], theirs[2]):
            fully_shard(unit, mesh=mesh, reshard_after_forward=reshard, mp_policy=policy)
        fully_shard(theirs, mesh=mesh, mp_policy=policy)  # the root keeps its parameters
        assert mine == one_step(theirs, x)
    traffic = model.step_traffic()
    gathers = [b for op, b, _ in mine if op == "all_gather"]
    scatters = [b for op, b, _ in mine if op == "reduce_scatter"]
    assert (len(gathers), sum(gathers)) == (traffic.all_gathers, traffic.all_gather_bytes)
    assert (len(scatters), sum(scatters)) == (traffic.reduce_scatters, traffic.reduce_scatter_bytes)
    # Units 0 and 2 (rows padded to 8 and 4), the root's Linear(3, 1) (1 row padded to 4).
    padded = [
        unit_numel([torch.Size([5, 6]), torch.Size([5])], 4),
        unit_numel([torch.Size([3, 5]), torch.Size([3])], 4),
        4 * 3 + 4,
    ]
    assert padded == [8 * 6 + 8, 4 * 5 + 4, 16]
    wire = 2 if compute_dtype else 4  # cast before the all-gather: half of float32's bytes
    gathered_twice = padded[:2] if reshard else []
    assert sorted(gathers) == sorted(wire * n for n in padded + gathered_twice)
    assert sorted(scatters) == sorted(4 * n for n in padded)  # always the parameters' float32
    dtypes = {op: {d for o, _, d in mine if o == op} for op in ("all_gather", "reduce_scatter")}
    assert dtypes == {
        "all_gather": {str(compute_dtype or torch.float32)},
        "reduce_scatter": {"torch.float32"},
    }


def test_full_weights_exist_only_while_their_unit_runs():
    with fake_ranks(0):
        net = make()
        model = wrap(net)
        seen = {}
        net[2].register_forward_pre_hook(lambda m, a: seen.update(inside=m.weight.shape))
        out = model(torch.randn(4, 6, dtype=torch.float64))
        units = model.unit_bytes()
        assert units == {"0": 8 * 56, "2": 8 * 24, "": 8 * 16}  # float64, padded rows
        assert seen["inside"] == (3, 5) and net[2].weight.shape == (1, 5)  # full, then the shard
        assert model.gathered_bytes() == units[""]  # after forward: the root's alone
        out.sum().backward()
        assert model.gathered_bytes() == 0
        assert model.peak_gathered_bytes == units[""] + units["0"] < sum(units.values())
        kept = wrap(make(), reshard_after_forward=False)
        kept(torch.randn(4, 6, dtype=torch.float64)).sum().backward()
        assert kept.peak_gathered_bytes == sum(units.values()) and kept.gathered_bytes() == 0
        kept_out = kept(torch.randn(4, 6, dtype=torch.float64))
        assert kept.gathered_bytes() == sum(units.values())  # kept from forward to backward
        del kept_out  # the graph goes, and its buffers with it
        assert kept.gathered_bytes() == 0
        with torch.no_grad():  # no backward will come: freed after each unit's forward
            kept(torch.randn(4, 6, dtype=torch.float64))
        assert kept.gathered_bytes() == 0


OPTIMIZERS = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=0.01),
}


def train_both(plain, model, optimizer, steps=3, casts=None):
    """Step ``plain`` (one process) and ``model`` (FSDP) on the same batches."""
    opt_plain = OPTIMIZERS[optimizer]([p for p in plain.parameters() if p.requires_grad])
    opt = OPTIMIZERS[optimizer]([p for p in model.parameters() if p.requires_grad])
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randn(4, 6, generator=gen, dtype=torch.float64)
        if casts is None:
            plain(x).square().mean().backward()
        else:  # the same casts: weights and input in bfloat16, the gradient cast up
            low = copy.deepcopy(plain).to(casts)
            low(x.to(casts)).double().square().mean().backward()
            for p, q in zip(plain.parameters(), low.parameters()):
                p.grad = q.grad.double()
        model(x).double().square().mean().backward()
        for p in model.parameters():
            assert p.grad is None or (p.grad.dtype, p.grad.shape) == (p.dtype, p.shape)
        for o in (opt_plain, opt):
            o.step()
            o.zero_grad()


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
@pytest.mark.parametrize("compute_dtype", [None, torch.bfloat16])
def test_one_rank_trains_like_one_process(optimizer, compute_dtype):
    with distributed(group_of_one=True):
        plain, net = make(), make()
        model = FSDP(net, units=[net[0]], compute_dtype=compute_dtype)
        assert list(model.parameters()) == list(net.parameters())  # the shards, no copies
        train_both(plain, model, optimizer, casts=compute_dtype)
        full = model.full_parameters()
    for name, p in plain.named_parameters():
        torch.testing.assert_close(full[name], p.detach(), rtol=0, atol=1e-12)


def make_tied():
    # Two Linear(5, 5) sharing one weight (their biases apart).
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Linear(6, 5),
        nn.Tanh(),
        nn.Linear(5, 5),
        nn.Tanh(),
        nn.Linear(5, 5),
        nn.Tanh(),
        nn.Linear(5, 1),
    ).double()
    net[4].weight = net[2].weight
    return net


def test_frozen_parameters_are_gathered_not_reduced():
    with distributed(group_of_one=True):
        plain, net = make(), make()
        for m in (plain, net):
            m[0].weight.requires_grad_(False)  # the first unit half frozen
            m[2].requires_grad_(False)  # the second unit frozen whole
        model = FSDP(net, units=[net[0], net[2]])
        train_both(plain, model, "sgd")
        assert model.gathered_bytes() == 0  # the frozen unit too, once backward is over
        full = model.full_parameters()
        model(torch.randn(4, 6, dtype=torch.float64)).sum().backward()
        grads = {n: p.grad for n, p in net.named_parameters()}
    for name, p in plain.named_parameters():
        torch.testing.assert_close(full[name], p.detach(), rtol=0, atol=1e-12)
    assert [n for n, g in grads.items() if g is None] == ["0.weight", "2.weight", "2.bias"]
    # The reduce-scatters: unit 0's bias and the root's Linear(3, 1); unit 2 none.
    assert model.step_traffic().reduce_scatters == 2


def test_tied_weights_in_one_unit_train_and_across_units_are_refused():
    with distributed(group_of_one=True):
        plain, net = make_tied(), make_tied()
        model = FSDP(net, units=[net[0]])  # both tied Linear in the root
        assert len(list(model.parameters())) == len(list(plain.parameters()))  # one shard
        train_both(plain, model, "adamw")
        full = model.full_parameters()
        tied = make_tied()
        with pytest.raises(ValueError, match="4.weight is tied to 2.weight, which another unit"):
            FSDP(tied, units=[tied[2]])
    for name, p in plain.named_parameters():
        torch.testing.assert_close(full[name], p.detach(), rtol=0, atol=1e-12)


def test_bad_input():
    with pytest.raises(RuntimeError, match="FSDP needs a process group"):
        FSDP(make())
    with distributed(group_of_one=True):
        scalar = nn.Module()
        scalar.p = nn.Parameter(torch.tensor(1.0))
        with pytest.raises(ValueError, match="0-d tensor"):
            FSDP(scalar)
        with pytest.raises(ValueError, match="submodule"):
            FSDP(make(), units=[nn.Linear(2, 2)])
        mixed = make()
        mixed[4].bias.data = mixed[4].bias.data.float()
        with pytest.raises(ValueError, match="mixes dtypes"):
            FSDP(mixed, units=[mixed[0]], sync_module_states=False)
