"""ZeRO from scratch: memory per rank against the paper, shards, byte counters, stages 1-3
against DDP (also under gradient accumulation, with SGD)."""

import pathlib

import pytest
import torch

from ddp_course.harness import launch
from ddp_course.runtime import distributed
from ddp_course.sharding import FP32_ADAM, FP32_SGD, MIXED_ADAM, ZeRO, state_bytes_per_rank
from ddp_course.tools.zero_counts import CollectiveBytes, held_bytes

GB = 1e9
WORKERS = pathlib.Path(__file__).resolve().parents[1] / "workers"


@pytest.mark.parametrize(
    ("stage", "paper_gb"),
    [(0, 120), (1, 31.4), (2, 16.6), (3, 1.88)],  # ZeRO paper, Figure 1: Psi = 7.5B, N = 64
)
def test_memory_matches_the_papers_figure_1(stage, paper_gb):
    got = state_bytes_per_rank(stage, 7_500_000_000, 64, MIXED_ADAM).total / GB
    assert got == pytest.approx(paper_gb, abs=0.05)


@pytest.mark.parametrize(
    ("world_size", "paper_gb"),
    # ZeRO paper, Table 1, 7.5B parameters, columns P_os, P_os+g, P_os+g+p, in GB.
    [
        (1, (120, 120, 120)),
        (4, (52.5, 41.3, 30)),
        (16, (35.6, 21.6, 7.5)),
        (1024, (30.1, 15.1, 0.12)),
    ],
)
def test_memory_matches_the_papers_table_1(world_size, paper_gb):
    for stage, want in zip((1, 2, 3), paper_gb):
        got = state_bytes_per_rank(stage, 7_500_000_000, world_size).total / GB
        assert got == pytest.approx(want, abs=0.05), f"stage {stage}"


def test_sixteen_bytes_per_parameter_and_fp32_adam():
    assert state_bytes_per_rank(0, 1, 8).total == 16  # 2 + 2 + 12
    fp32 = state_bytes_per_rank(2, 1000, 4, FP32_ADAM)
    assert (fp32.params, fp32.grads, fp32.optimizer) == (4000, 1000, 2000)


def test_sgd_without_momentum_keeps_no_optimizer_state():
    model = torch.nn.Linear(6, 5)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randn(2, 6)).sum().backward()
    opt.step()
    held = held_bytes(model, opt)
    want = dict(params=4 * 35, grads=4 * 35, optimizer=0)  # 35 parameters, float32
    assert held.__dict__ == state_bytes_per_rank(0, 35, 1, FP32_SGD).__dict__ == want


@pytest.mark.parametrize("bad", [dict(stage=4), dict(num_params=-1), dict(world_size=0)])
def test_memory_bad_input(bad):
    kwargs = dict(stage=1, num_params=10, world_size=2) | bad
    with pytest.raises(ValueError, match=next(iter(bad))):
        state_bytes_per_rank(**kwargs)


def test_zero_bad_input():
    model = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="stage must be 1, 2 or 3"):
        ZeRO(model, torch.optim.Adam, stage=0)
    with pytest.raises(RuntimeError, match="ZeRO needs a process group.*torchrun"):
        ZeRO(model, torch.optim.Adam, stage=1)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_one_rank_equals_plain_adam(stage):
    # The path of `python scripts/09_zero.py`: a process group of one rank.
    torch.manual_seed(0)
    plain = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3))
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3))
    model.load_state_dict(plain.state_dict())
    opt = torch.optim.Adam(plain.parameters(), lr=0.01)
    with distributed(group_of_one=True):
        zero = ZeRO(model, torch.optim.Adam, stage, lr=0.01)
        for _ in range(3):
            x = torch.randn(4, 6)
            for m, step, zero_grad in (
                (plain, opt.step, opt.zero_grad),
                (zero, zero.step, zero.zero_grad),
            ):
                m(x).square().mean().backward()
                step()
                zero_grad()
        full = zero.full_parameters()
    for name, p in plain.named_parameters():
        torch.testing.assert_close(full[name], p.detach(), rtol=0, atol=0)


def test_held_bytes_of_a_plain_model_is_ddps_16_bytes_per_parameter():
    # What every DDP rank holds with fp32 Adam: 4 + 4 + 8 bytes a parameter, + step counters.
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3))
    opt = torch.optim.Adam(model.parameters())
    with pytest.raises(ValueError, match="needs the module's optimizer"):
        held_bytes(model)
    psi = sum(p.numel() for p in model.parameters())
    assert held_bytes(model, opt).__dict__ == dict(params=4 * psi, grads=0, optimizer=0)
    model(torch.randn(2, 6)).sum().backward()
    opt.step()
    held = held_bytes(model, opt)
    assert (held.params, held.grads, held.optimizer) == (4 * psi, 4 * psi, 8 * psi + 4 * 4)
    assert held.total == pytest.approx(state_bytes_per_rank(0, psi, 1, FP32_ADAM).total, rel=0.1)


def test_collective_bytes_reads_the_tensors_torch_sees():
    with distributed(group_of_one=True):
        with CollectiveBytes() as sent:
            torch.distributed.all_reduce(torch.ones(10))
            torch.distributed.broadcast(torch.ones(3, dtype=torch.float64), src=0)
            torch.distributed.barrier()  # no tensor of the caller's: not recorded
            out = torch.empty(4)
            torch.distributed.all_gather_into_tensor(out, torch.ones(4))
            torch.distributed.reduce_scatter_tensor(out, torch.ones(4))
    assert sent.calls == [
        ("all_reduce", 40),
        ("broadcast", 24),
        ("all_gather", 16),
        ("reduce_scatter", 16),
    ]
    assert sent.bytes_of("all_gather") == 16
    assert sent.volume_bytes == 2 * 40 + 24 + 16 + 16  # an all-reduce counts twice


def test_zero_redundancy_optimizer_sends_one_and_a_half_times_ddps_bytes():
    # DDP's all-reduce (2 Psi in the paper's units), then every parameter broadcast by its
    # owner (Psi). The third step: DDP's second forward also broadcasts its bucket order.
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    with distributed(group_of_one=True):
        model = DDP(torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 3)))
        opt = ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, lr=0.01)
        for _ in range(3):
            with CollectiveBytes() as sent:
                model(torch.randn(4, 6)).sum().backward()
                opt.step()
    psi = 6 * 5 + 5 + 5 * 3 + 3
    assert sent.bytes_of("all_reduce") == sent.bytes_of("broadcast") == 4 * psi
    assert sent.volume_bytes == 3 * 4 * psi


# ---- stages 1-3 on 2 and 3 gloo ranks (one job per world size checks everything) ----

GAP = 1e-6  # float rounding of a different summation order; the stages are exact on 2 ranks
FP32 = 4  # bytes per parameter, per gradient; Adam keeps 2 values (8 bytes) per parameter


@pytest.fixture(scope="module")
def jobs():
    cache = {}

    def run(nproc):
        if nproc not in cache:
            worker = WORKERS / "sharding_equivalence.py"
            job = launch.torchrun(
                worker, ["--steps", "4"], nproc=nproc, results=True, echo=False, timeout_s=240
            )
            cache[nproc] = job.results
        return cache[nproc]

    return run


def check_stage(r, variant, stage):
    """Everything lesson 09 claims about one stage; AssertionError names what is off."""
    psi, n, case = r["num_params"], r["world_size"], r[variant]
    assert len(case["per_rank"]) == n
    assert case["gap"] < GAP, f"parameters differ from DDP's by {case['gap']:.2e}"
    for rank, got in enumerate(case["per_rank"]):
        held, own = got["held"], got["own"]
        want_params = FP32 * (own if stage == 3 else psi)
        want_grads = FP32 * (own if stage >= 2 else psi)
        want_optim = 2 * FP32 * own + 4 * got["tensors"]  # + Adam's float32 step counters
        assert held["params"] == want_params, f"rank {rank} holds {held['params']} B of params"
        assert held["grads"] == want_grads, f"rank {rank} holds {held['grads']} B of grads"
        assert held["optimizer"] == want_optim, f"rank {rank} holds {held['optimizer']} B of state"
        for kind, formula in case["formula"].items():  # the paper's formula, within 10%
            assert held[kind] == pytest.approx(formula, rel=0.1), f"rank {rank} {kind}"
    if stage == 3:  # full parameters only for the layers in use, never the whole model
        peak, layers = case["peak_gathered"], r["layer_bytes"]
        assert max(layers) <= peak < sum(layers), f"{peak} B gathered at once, layers {layers}"
    # ZeRO's log holds every collective torch saw (CommDebugMode), no more, no fewer.
    logged = case["logged_calls"]
    ours = {
        "c10d._allgather_base_": logged.count("all_gather"),
        "c10d._reduce_scatter_base_": logged.count("reduce_scatter"),
    }
    ours = {op: count for op, count in ours.items() if count}
    assert case["torch_counts"] == ours, f"the log misses a collective torch saw: {ours}"
    # Communication: DDP all-reduces 2 Psi values per step; stages 1 and 2 the same
    # (reduce-scatter Psi + all-gather Psi), stage 3 one all-gather more: 3 Psi.
    assert r["ddp_volume"] == 2 * FP32 * psi
    want_volume = r["ddp_volume"] * (3 if stage == 3 else 2) // 2
    assert case["volume"] == want_volume, f"{case['volume']} B communicated, not {want_volume}"


@pytest.mark.parametrize("nproc", [2, 3])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_stage_equals_ddp_memory_and_bytes(jobs, nproc, stage):
    r = jobs(nproc)
    assert r["world_size"] == nproc
    check_stage(r, f"stage{stage}", stage)
    # The model's one-element parameter leaves every rank but rank 0 an empty shard.
    assert [got["empty"] for got in r[f"stage{stage}"]["per_rank"]] == [0] + [1] * (nproc - 1)


@pytest.mark.parametrize("nproc", [2, 3])
@pytest.mark.parametrize(
    ("variant", "stage", "caught"),
    [
        # Adam divides by the gradient's own scale, so a sum instead of an
        # average moves the parameters only through eps: small, but far above GAP.
        ("stage1-sum", 1, "parameters differ"),
        ("stage3-sum", 3, "parameters differ"),
        ("stage2-no-gather", 2, "parameters differ"),
        # Same parameters as DDP, but the optimizer state is not sharded.
        ("stage1-whole-optimizer", 1, "B of state"),
        ("stage2-unlogged", 2, "the log misses a collective"),
        # Same parameters and bytes after the step, but the whole model was gathered at once.
        ("stage3-no-reshard", 3, "gathered at once"),
    ],
)
def test_broken_stages_are_caught(jobs, nproc, variant, stage, caught):
    with pytest.raises(AssertionError, match=caught):
        check_stage(jobs(nproc), variant, stage)


@pytest.mark.parametrize("nproc", [2, 3])
def test_not_freeing_after_forward_trades_memory_for_one_all_gather(jobs, nproc):
    r = jobs(nproc)
    kept, freed = r["stage3-no-reshard"], r["stage3"]
    assert kept["gap"] < GAP  # still trains like DDP
    assert kept["peak_gathered"] == sum(r["layer_bytes"])  # the whole model at once
    assert freed["peak_gathered"] == max(r["layer_bytes"])  # one layer at a time
    assert kept["volume"] == r["ddp_volume"] < freed["volume"]  # no all-gather in backward


@pytest.mark.parametrize("nproc", [2, 3])
def test_models_that_differ_across_ranks_are_refused(jobs, nproc):
    message = jobs(nproc)["mismatch_error"]
    assert message is not None and "differs from rank 0" in message
    assert "Build the same model on every rank" in message


# ---- gradient accumulation: two backward passes per step, SGD, against DDP and one process ----


@pytest.fixture(scope="module")
def accumulation():
    worker = WORKERS / "zero_accumulation.py"
    job = launch.torchrun(
        worker, ["--micro", "2"], nproc=2, results=True, echo=False, timeout_s=240
    )
    return job.results


def check_accumulation(r, variant):
    assert r["micro"] == 2
    assert r["ddp_moved"] > 1e-3, "SGD hardly moved: a lost micro-batch would not show"
    assert r["ddp_vs_single"] < GAP, "DDP with accumulation differs from one process"
    assert r[variant] < GAP, f"{variant} differs from DDP by {r[variant]:.2e} under accumulation"


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_accumulates_gradients_over_backward_passes_like_ddp(accumulation, stage):
    check_accumulation(accumulation, f"stage{stage}")


@pytest.mark.parametrize("variant", ["stage2-overwrite", "stage3-overwrite"])
def test_a_shard_gradient_that_overwrites_is_caught(accumulation, variant):
    # Only the last micro-batch's gradient is stepped: every test above still passes.
    with pytest.raises(AssertionError, match="under accumulation"):
        check_accumulation(accumulation, variant)


# ---- FSDP2's units in one process: storage of a model built on meta, the order of hooks ----


def test_a_model_built_on_meta_occupies_nothing_until_to_empty_then_loads_rank_0s():
    # Lesson 09's recipe at one rank; notebook 09 runs it at two and compares training.
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from ddp_course.tools.fsdp_units import parameter_storage_bytes

    torch.manual_seed(0)
    plain = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3))
    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3))
    whole = 4 * sum(p.numel() for p in plain.parameters())
    assert parameter_storage_bytes(plain) == whole
    assert parameter_storage_bytes(model) == 0
    assert model[0].weight.untyped_storage().nbytes() == 4 * 30  # what a meta storage reports
    with distributed(group_of_one=True):
        fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
        assert parameter_storage_bytes(model) == 0
        model.to_empty(device="cpu")
        assert parameter_storage_bytes(model) == whole  # one rank: its shard is everything
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
        set_model_state_dict(model, plain.state_dict(), options=options)
        for p, want in zip(model.parameters(), plain.parameters()):
            torch.testing.assert_close(p.full_tensor(), want, rtol=0, atol=0)


def test_unit_order_puts_each_collective_between_the_units_hooks():
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from ddp_course.tools.fsdp_units import UnitOrder, position, unit_gather_bytes

    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3))
    units = {"0": model[0], "2": model[2]}
    with distributed(group_of_one=True):
        mesh = init_device_mesh("cpu", (1,))
        for unit in units.values():
            fully_shard(unit, mesh=mesh)
        fully_shard(model, mesh=mesh)
        assert unit_gather_bytes(model[0]) == 4 * (5 * 6 + 5)  # one rank: nothing padded
        with pytest.raises(ValueError, match="same bytes"):
            UnitOrder({"a": model[0], "b": model[0]})
        order = UnitOrder(units)
        with order.recording():
            model(torch.randn(2, 6)).sum().backward()  # one rank: FSDP2 gathers nothing
            dist.all_gather_into_tensor(torch.empty(35), torch.ones(35))  # unit 0's bytes
            dist.all_reduce(torch.ones(3))  # no unit's
        model(torch.randn(2, 6))  # after the block: not recorded, the hooks are gone
    assert order.events == [
        ("forward", "0"),
        ("forward done", "0"),
        ("forward", "2"),
        ("forward done", "2"),
        ("backward", "2"),
        ("backward", "0"),
        ("all_gather", "0"),
        ("all_reduce", None),
    ]
    assert position(order.events, ("backward", "0")) == 5
    assert position([list(e) for e in order.events], ("all_gather", "0")) == 6  # as from JSON
    with pytest.raises(ValueError, match="1 times, not 2"):
        position(order.events, ("backward", "0"), 1)
