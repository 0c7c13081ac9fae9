"""The course's GPU paths, run on this machine's GPUs: nccl with one rank per GPU, the CPU
fallback when ranks outnumber GPUs, DataParallel (torch's and the course's), autocast with
GradScaler, SyncBatchNorm, the pipeline's CUDA clock, FSDP2 and the benchmark's nccl sweep.

Every test is skipped, with its reason shown by ``pytest -ra``, on a machine without a
GPU (or with too few). ``python -m ddp_course gpu-check`` runs this file on a GPU
machine; the tests then keep each script's JSON results in the folder named by
``$DDP_COURSE_GPU_RESULTS`` (:data:`ddp_course.harness.gpu_check.RESULTS_ENV`), which it copies
next to its summary in ``benchmarks/gpu-<GPU name>/``; without that variable nothing is
kept. Settings are tiny: the whole file takes a few minutes on one GPU, mostly process
start-up. The nccl jobs run one rank per GPU, at most :data:`MAX_RANKS`.

With one GPU every nccl job has world size 1: an all-reduce is a local copy, busbw is 0
by definition, SyncBatchNorm is BatchNorm, a pipeline has one stage, FSDP2 shards nothing.
The tests that check those multi-rank paths are therefore skipped there, each with a reason
that starts with "world size 1" and names what was not exercised; gpu-check lists them in
its summary, and names the result files of world size 1 ``*-world-size-1.json``.

Marked serial: the jobs use every GPU, and two tests read clocks.
"""

import math
import pathlib

import pytest
import torch
from gpu_support import GPUS, RANKS, keep, needs_gpu, run, world_size_1
from torch import nn
from torch.nn.functional import cross_entropy

from ddp_course import pipeline, runtime
from ddp_course.checkpoint import load_checkpoint
from ddp_course.data_parallel import DataParallel
from ddp_course.models import SmallCNN
from ddp_course.tools.bench import COLLECTIVES, busbw_factor

pytestmark = pytest.mark.serial

ROOT = pathlib.Path(__file__).resolve().parents[2]


def run_kept(name: str, script: str, args=(), **kwargs) -> dict:
    """``scripts/<script>`` run as ``gpu_support.run`` does, its results kept as ``<name>.json``."""
    r = run(ROOT, script, args, **kwargs)
    keep(name, r)
    return r


@pytest.fixture(scope="module")
def hello():
    """00_hello_ranks.py with one rank per GPU: an all_reduce of the ranks over nccl."""
    return run_kept("00_hello_ranks", "00_hello_ranks.py")


# ---------------------------------------------------------------- nccl and the fallback


@needs_gpu
def test_nccl_with_one_rank_per_gpu(hello):
    assert (hello["backend"], hello["world_size"]) == ("nccl", RANKS)
    assert hello["sum"] == RANKS * (RANKS + 1) // 2  # an all_reduce over nccl


@needs_gpu
@world_size_1("all_reduce between GPUs (with one rank it is a local copy)")
def test_nccl_all_reduce_sums_over_several_gpus(hello):
    assert hello["world_size"] >= 2 and hello["sum"] == RANKS * (RANKS + 1) // 2


@needs_gpu
def test_ddp_script_trains_on_gpus():
    r = run_kept(
        "05_train_ddp", "05_train_ddp.py", ["--epochs", "1", "--max-steps", "20", "--no-progress"]
    )
    assert r["device"].startswith("cuda") and r["backend"] == "nccl"
    assert r["world_size"] == RANKS and r["test_samples"] in (1000, 10000)
    assert math.isfinite(r["train_loss"])


@needs_gpu
def test_more_ranks_than_gpus_fall_back_to_cpu_and_gloo(capsys):
    nproc = GPUS + 1
    plan = runtime.device_plan(nproc, GPUS)
    assert plan.fallback and (plan.device_type, plan.backend) == ("cpu", "gloo")
    args = ["--epochs", "1", "--max-steps", "5", "--no-progress"]
    r = run_kept("05_train_ddp_fallback", "05_train_ddp.py", args, nproc=nproc, gpus=GPUS)
    out = capsys.readouterr().out.splitlines()
    # One line says why, and the command shown is the one that runs.
    assert out.count(plan.reason) == 1, out
    assert any(line.startswith("$ DDP_COURSE_DEVICE=cpu torchrun") for line in out), out
    assert (r["device"], r["backend"], r["world_size"]) == ("cpu", "gloo", nproc)


# ---------------------------------------------------------------- lesson 07


@needs_gpu
def test_autocast_and_grad_scaler_train_on_gpus():
    # On CUDA the script's "autocast" run is float16 with a GradScaler (bfloat16 on CPU).
    r = run_kept("07_mixed_precision", "07_mixed_precision.py", ["--max-steps", "30"])
    assert r["device"].startswith("cuda") and r["world_size"] == RANKS
    v = r["variants"]
    assert all(s["steps"] == 30 for s in v.values()), v
    # A scaler that skipped every step (inf/NaN gradients) would leave chance accuracy.
    assert v["float32"]["accuracy"] > 0.5 and v["autocast"]["accuracy"] > 0.5, v
    assert abs(v["autocast"]["accuracy"] - v["float32"]["accuracy"]) < 0.1, v
    # fp16 compression halves the bytes of the float32 all-reduce, on nccl too.
    assert v["fp16 hook"]["bytes_per_step"] * 2 == v["float32"]["bytes_per_step"]


@pytest.fixture(scope="module")
def sync_batchnorm():
    """07_sync_batchnorm.py with one rank per GPU."""
    return run_kept("07_sync_batchnorm", "07_sync_batchnorm.py")


@needs_gpu
def test_sync_batchnorm_on_gpus(sync_batchnorm):
    r = sync_batchnorm
    assert r["world_size"] == RANKS
    # torch's nn.SyncBatchNorm runs on CUDA only; the script compares it with BatchNorm
    # on the global batch there (with one GPU it is plain BatchNorm: nothing to sync).
    assert r["torch_sync_batchnorm"] == "equal to BatchNorm on the global batch"
    assert max(r["sync_diffs"].values()) <= 1e-4


@needs_gpu
@world_size_1("SyncBatchNorm's statistics exchange (one rank is plain BatchNorm)")
def test_sync_batchnorm_exchanges_statistics_between_gpus(sync_batchnorm):
    assert sync_batchnorm["world_size"] >= 2
    assert sync_batchnorm["torch_sync_batchnorm"] == "equal to BatchNorm on the global batch"


# ---------------------------------------------------------------- lesson 08


@pytest.fixture(scope="module")
def pipeline_run():
    """08_pipeline.py with one stage per GPU, every schedule."""
    args = ["--stage-cost-s", "0", "--microbatches", str(RANKS), "--batch-size", "32"]
    return run_kept("08_pipeline", "08_pipeline.py", args)


@needs_gpu
@world_size_1("point-to-point sends of activations and gradients between pipeline stages")
def test_pipeline_stages_on_several_gpus_all_work(pipeline_run):
    assert pipeline_run["world_size"] >= 2
    for one in pipeline_run["runs"]:
        assert {e["rank"] for e in one["timeline"]} == set(range(RANKS)), one["schedule"]


@needs_gpu
def test_pipeline_script_on_gpus(pipeline_run):
    r = pipeline_run
    assert r["device"].startswith("cuda") and r["world_size"] == RANKS
    assert {run["schedule"] for run in r["runs"]} == set(pipeline.SCHEDULES)
    for one in r["runs"]:
        assert one["grad_diff"] <= 1e-5  # the script asserts it too, per rank
        for rank in range(RANKS):
            mine = sorted(
                (e for e in one["timeline"] if e["rank"] == rank), key=lambda e: e["start"]
            )
            assert mine, (one["schedule"], rank)
            # One rank does one thing at a time: its actions never overlap.
            for before, after in zip(mine, mine[1:]):
                assert before["end"] <= after["start"], (one["schedule"], before, after)


# ---------------------------------------------------------------- lesson 09


@pytest.fixture(scope="module")
def fsdp(tmp_path_factory):
    """One FSDP2 job on every GPU (at most MAX_RANKS) that saves a sharded checkpoint."""
    folder = tmp_path_factory.mktemp("fsdp") / "ckpt"
    r = run_kept(
        "09_fsdp", "09_fsdp.py", ["--steps", "2", "--hidden", "32", "--checkpoint", str(folder)]
    )
    return r, folder


@needs_gpu
def test_fsdp2_on_gpus(fsdp):
    r, _ = fsdp
    assert (r["device"], r["world_size"]) == ("cuda", RANKS)
    for kind, per_rank in r["variants"].items():
        assert len(per_rank) == RANKS, kind
        assert all(m["cuda_peak_bytes"] > 0 for m in per_rank), kind
        assert per_rank[0]["gap"] <= 1e-5, kind  # equal to DDP (asserted in the script)
    assert r["checkpoint"]["saved_world_size"] == RANKS
    assert r["reload"]["world_size"] == RANKS


@needs_gpu
@world_size_1("FSDP2's sharding of parameters between GPUs (one rank holds them all)")
def test_fsdp2_shards_over_several_gpus(fsdp):
    r, _ = fsdp
    assert r["world_size"] >= 2
    assert all(len(per_rank) == RANKS for per_rank in r["variants"].values())


@needs_gpu
@world_size_1("a sharded checkpoint loaded on fewer GPUs than saved it")
def test_fsdp2_checkpoint_loads_on_fewer_gpus(fsdp):
    _, folder = fsdp
    r = run_kept(
        "09_fsdp_resume", "09_fsdp.py", ["--hidden", "32", "--resume", str(folder)], nproc=RANKS - 1
    )
    assert (r["device"], r["world_size"]) == ("cuda", RANKS - 1)
    assert r["resume"]["changed_by_load"] > 0  # the fresh model really was replaced


# ---------------------------------------------------------------- lesson 10


@pytest.fixture(scope="module")
def sweep():
    """10_benchmark.py's collectives sweep with one rank per GPU."""
    args = [
        "collectives",
        "--min-bytes",
        "4096",
        "--max-bytes",
        str(16 * 2**20),
        "--warmup",
        "2",
        "--repeats",
        "5",
        "--no-progress",
    ]
    return run_kept("10_benchmark_collectives", "10_benchmark.py", args)


@needs_gpu
@world_size_1("busbw between GPUs (0 by definition for every collective but broadcast)")
def test_benchmark_busbw_is_measured_between_gpus(sweep):
    assert sweep["meta"]["world_size"] >= 2
    all_reduce = [row for row in sweep["rows"] if row["collective"] == "all_reduce"]
    assert all_reduce and all(row["busbw_GBps"] > 0 for row in all_reduce)


@needs_gpu
def test_benchmark_nccl_sweep(sweep):
    r = sweep
    meta, rows = r["meta"], r["rows"]
    assert (meta["backend"], meta["world_size"]) == ("nccl", RANKS)
    assert meta["device"].startswith("cuda") and meta["gpu"]
    assert {row["collective"] for row in rows} == set(COLLECTIVES)
    assert sorted({row["bytes"] for row in rows})[-1] == 16 * 2**20
    for row in rows:
        assert row["median_s"] > 0 and row["repeats"] == 5
        assert row["busbw_GBps"] == pytest.approx(
            row["algbw_GBps"] * busbw_factor(row["collective"], RANKS)
        )


@needs_gpu
def test_benchmark_every_mode_tiny_on_gpus():
    r = run_kept("10_benchmark_tiny", "10_benchmark.py", ["all", "--tiny", "--no-progress"])
    assert (r["meta"]["backend"], r["meta"]["world_size"]) == ("nccl", RANKS)
    assert {row["mode"] for row in r["rows"]} == {
        "collectives",
        "scaling",
        "knobs",
        "model",
        "trace",
    }


# ---------------------------------------------------------------- in this process
# Last: these hold a CUDA context in the pytest process until it exits. On GPUs in
# exclusive-process mode a torchrun job started after them could not use GPU 0.


@needs_gpu
def test_a_plain_process_group_of_one_uses_nccl_on_a_gpu(monkeypatch):
    import torch.distributed as dist

    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    with runtime.distributed(group_of_one=True) as ctx:
        assert (ctx.device.type, ctx.backend) == ("cuda", "nccl")
        t = torch.ones(1, device=ctx.device)
        dist.all_reduce(t)
        assert t.item() == 1.0


@needs_gpu
def test_a_checkpoint_loaded_onto_a_gpu_keeps_adams_step_on_the_host(tmp_path):
    # map_location="cuda" puts every saved tensor on the GPU; load_state_dict then leaves
    # a non-fused optimizer's step there, where a new optimizer keeps it on the host.
    torch.manual_seed(0)
    model = SmallCNN().cuda()
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 1, 28, 28, device="cuda")).sum().backward()
    optimizer.step()
    path = tmp_path / "model.pt"
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, path)
    restored = SmallCNN().cuda()
    restored_opt = torch.optim.Adam(restored.parameters())
    load_checkpoint(path, restored, restored_opt, map_location="cuda")
    saved, loaded = optimizer.state_dict()["state"], restored_opt.state_dict()["state"]
    for key, state in saved.items():
        for name, value in state.items():
            torch.testing.assert_close(loaded[key][name], value, msg=f"{key} {name}")
    assert {s["step"].device.type for s in loaded.values()} == {"cpu"}
    assert {s["exp_avg"].device.type for s in loaded.values()} == {"cuda"}


def _gradients(model, x, y, wrap):
    nn.functional.cross_entropy(wrap(model)(x), y).backward()
    return [p.grad for p in model.parameters()]


@needs_gpu
def test_torch_and_scratch_data_parallel_give_the_same_gradients():
    runtime.no_tf32()  # cuDNN convolutions use TF32 by default: 1e-3, not 1e-5
    torch.manual_seed(0)
    reference = SmallCNN(dropout=False).cuda()
    batch = 4 * max(GPUS, 4)  # every replica gets samples
    x = torch.randn(batch, 1, 28, 28, device="cuda")
    y = torch.randint(0, 10, (batch,), device="cuda")
    scratch = {}

    def ours(m):
        scratch["dp"] = DataParallel(m)  # default devices: one replica per GPU
        return scratch["dp"]

    grads = []
    for wrap in (lambda m: m, nn.DataParallel, ours):
        model = SmallCNN(dropout=False).cuda()
        model.load_state_dict(reference.state_dict())
        grads.append(_gradients(model, x, y, wrap))
    assert scratch["dp"].devices == runtime.replica_devices(None, GPUS)
    assert scratch["dp"].devices == [torch.device("cuda", i) for i in range(GPUS)]
    for plain, torch_dp, from_scratch in zip(*grads, strict=True):
        torch.testing.assert_close(torch_dp, plain, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(from_scratch, plain, rtol=1e-4, atol=1e-5)


@needs_gpu
def test_scratch_data_parallel_with_more_replicas_than_gpus_runs_on_cpu():
    # The device rule for replicas: never two on one GPU, so GPUS + 1 replicas go to the CPU.
    n = GPUS + 1
    assert runtime.replica_devices(n, GPUS) == [torch.device("cpu")] * n
    torch.manual_seed(0)
    reference = SmallCNN(dropout=False)
    x, y = torch.randn(2 * n, 1, 28, 28), torch.randint(0, 10, (2 * n,))
    model = SmallCNN(dropout=False)
    model.load_state_dict(reference.state_dict())
    dp = DataParallel(model, num_replicas=n)
    assert dp.devices == [torch.device("cpu")] * n
    for ours, plain in zip(
        _gradients(model, x, y, lambda m: dp), _gradients(reference, x, y, lambda m: m), strict=True
    ):
        torch.testing.assert_close(ours, plain, rtol=1e-4, atol=1e-5)


@needs_gpu
def test_pipeline_clock_waits_for_the_gpu():
    """Each backward action's time stamps bracket the GPU work of its kernels.

    CUDA kernels run asynchronously: without ``torch.cuda.synchronize`` before the
    clock is read, ``backward()`` returns once its kernels are queued and the action
    looks nearly free. Events recorded on the GPU inside the backward (after the last
    layer's gradient, after the first layer's) measure the kernels between them; the
    host interval of the action must contain that. The layers are wide so that the
    kernels take far longer (milliseconds) than queueing them (microseconds).
    (Forward actions of the last stage end with ``loss.item()``, which waits anyway.)
    """
    device = torch.device("cuda", 0)
    runtime.no_tf32()
    width, m = 4096, 2
    torch.manual_seed(0)
    stage = nn.Sequential(*[nn.Linear(width, width) for _ in range(6)], nn.Linear(width, 10))
    stage = stage.to(device)
    events = {"first": [], "last": []}

    def mark(which):
        def hook(param):
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            events[which].append(e)

        return hook

    # Backward computes the last layer's gradient first and the first layer's last.
    stage[-1].weight.register_post_accumulate_grad_hook(mark("first"))
    stage[0].weight.register_post_accumulate_grad_hook(mark("last"))
    x = torch.randn(m * width, width)
    y = torch.randint(0, 10, (m * width,))
    for _ in range(2):  # the first run pays for cuBLAS's start-up
        for key in events:
            events[key].clear()
        stage.zero_grad()
        result = pipeline.run_schedule(
            pipeline.schedule("gpipe", 1, m),
            stage,
            0,
            inputs=pipeline.split_microbatches(x, m),
            targets=pipeline.split_microbatches(y, m),
            loss_fn=cross_entropy,
        )
    torch.cuda.synchronize(device)
    backward = [e for e in result.events if e.action.kind == "B"]
    assert len(backward) == m == len(events["first"]) == len(events["last"])
    for action, a, b in zip(backward, events["first"], events["last"], strict=True):
        gpu_s = a.elapsed_time(b) / 1e3  # milliseconds on the GPU's clock
        host_s = action.end - action.start
        assert gpu_s > 0
        # 1% for the two clocks' resolutions; without the synchronize host_s is ~1e-4 s.
        assert host_s >= 0.99 * gpu_s, (action, host_s, gpu_s)
