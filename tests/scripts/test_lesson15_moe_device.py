"""15_moe.py reduces its differences on ctx.device, the device its process group serves.

On a GPU machine ``runtime.distributed()`` initialises nccl, whose only backend serves
CUDA (its device map is ``{'cuda': 'nccl'}``), so a tensor built without ``device=``
(on the CPU) is refused by ``dist.all_reduce``. No CUDA here; the same refusal on CPU: a
group whose backend is registered for cuda only (``"cuda:gloo"``) refuses a CPU tensor.
The script's ``max_over_ranks`` then runs against a group that serves only ctx.device,
with torch's default device moved elsewhere ("meta") so that a tensor built without
``device=`` cannot land on ctx.device by chance.
"""

import gc
import importlib.util
import pathlib

import pytest
import torch
import torch.distributed as dist

from ddp_course.runtime import DistContext

ROOT = pathlib.Path(__file__).resolve().parents[2]


def load_script():
    spec = importlib.util.spec_from_file_location("moe15", ROOT / "scripts" / "15_moe.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def group_of_one(backend):
    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)


def close():
    gc.collect()
    dist.destroy_process_group()


def test_nccl_serves_cuda_only_and_such_a_group_refuses_a_cpu_tensor():
    config = dist.BackendConfig(dist.Backend("nccl"))
    assert config.get_device_backend_map() == {"cuda": "nccl"}
    group_of_one("cuda:gloo")
    try:
        with pytest.raises(RuntimeError, match="No backend type associated with device type cpu"):
            dist.all_reduce(torch.tensor(1.0, dtype=torch.float64), op=dist.ReduceOp.MAX)
    finally:
        close()


def test_max_over_ranks_reduces_on_ctx_device(monkeypatch):
    moe = load_script()
    ctx = DistContext(device=torch.device("cpu"), backend="cpu:gloo")
    reached = []
    real = dist.all_reduce

    def all_reduce(tensor, *args, **kwargs):
        reached.append(tensor.device)
        return real(tensor, *args, **kwargs)

    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    group_of_one("cpu:gloo")  # serves ctx.device's type only, as nccl serves cuda only
    torch.set_default_device("meta")  # where a tensor without device= would go
    try:
        value = moe.max_over_ranks(ctx, 3.5)
    except (RuntimeError, NotImplementedError) as e:
        value = e
    finally:
        torch.set_default_device(None)
        close()
    assert reached == [ctx.device], f"all_reduce got a tensor on {reached}, not on ctx.device"
    assert value == 3.5
