"""GPU paths: nccl, the scripts on CUDA, torch's DataParallel. Skipped, with the
reason shown by ``pytest -ra``, on machines without a GPU."""

import pytest
import torch
from torch import nn

from ddp_course import launch
from ddp_course.models import SmallCNN
from ddp_course.parallel import DataParallel

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
needs_gpu = pytest.mark.skipif(GPUS == 0, reason="needs a CUDA GPU (nccl, DataParallel)")


@needs_gpu
def test_nccl_with_one_rank(root):
    job = launch.torchrun(root / "scripts/00_hello_ranks.py", nproc=1, results=True, echo=False)
    assert job.results["backend"] == "nccl" and job.results["sum"] == 1


@needs_gpu
def test_ddp_script_trains_on_gpus(root):
    nproc = min(GPUS, 2)
    job = launch.torchrun(root / "scripts/05_train_ddp.py",
                          ["--epochs", "1", "--max-steps", "20", "--no-progress"],
                          nproc=nproc, results=True, echo=False)  # fmt: skip
    r = job.results
    assert r["device"].startswith("cuda") and r["backend"] == "nccl"
    assert r["world_size"] == nproc and r["test_samples"] in (1000, 10000)


@needs_gpu
def test_torch_and_scratch_data_parallel_give_the_same_gradients():
    torch.manual_seed(0)
    reference = SmallCNN(dropout=False).cuda()
    x = torch.randn(16, 1, 28, 28, device="cuda")
    y = torch.randint(0, 10, (16,), device="cuda")
    grads = []
    for wrap in (lambda m: m, nn.DataParallel, lambda m: DataParallel(m, num_replicas=GPUS)):
        model = SmallCNN(dropout=False).cuda()
        model.load_state_dict(reference.state_dict())
        nn.functional.cross_entropy(wrap(model)(x), y).backward()
        grads.append([p.grad for p in model.parameters()])
    for plain, torch_dp, scratch in zip(*grads, strict=True):
        torch.testing.assert_close(torch_dp, plain, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(scratch, plain, rtol=1e-4, atol=1e-5)


@needs_gpu
def test_a_plain_process_group_of_one_uses_nccl_on_a_gpu(monkeypatch):
    import torch.distributed as dist

    from ddp_course import runtime

    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", runtime.DEVICE_ENV):
        monkeypatch.delenv(name, raising=False)
    with runtime.distributed(group_of_one=True) as ctx:
        assert (ctx.device.type, ctx.backend) == ("cuda", "nccl")
        t = torch.ones(1, device=ctx.device)
        dist.all_reduce(t)
        assert t.item() == 1.0
