"""The course's one rule for the bytes a rank holds (ddp_course.tools.zero_counts)."""

import pytest
import torch
import torch.distributed as dist
from torch import nn

from ddp_course.tools.zero_counts import held_bytes, held_state_bytes, storage_bytes


def test_a_view_of_a_parameter_costs_nothing_more():
    p = nn.Parameter(torch.zeros(10))  # 40 bytes
    shard = p.detach()[2:5]  # a ZeRO-style shard: a view of the same storage
    assert storage_bytes([p, shard, None]) == 40
    seen: set[int] = set()
    assert storage_bytes([p], seen) + storage_bytes([shard], seen) == 40  # across calls too
    assert storage_bytes([torch.empty(3, device="meta")]) == 0  # no data
    # Gradients viewed into one bucket (DDP's gradient_as_bucket_view): the bucket, once.
    a, b = nn.Parameter(torch.zeros(3)), nn.Parameter(torch.zeros(5))
    bucket = torch.zeros(10)  # 8 elements of gradients, 2 of padding
    a.grad, b.grad = bucket[:3], bucket[3:8]
    held = held_state_bytes([a, b])
    assert held == {"params": 32, "grads": 40, "optimizer": 0, "steps": 0}


def test_per_tensor_counts_elements_not_padding():
    padded = torch.zeros(8)  # FSDP2-style: a shard of 5 rows in a buffer of 8
    shard = padded[:5]
    assert storage_bytes([shard]) == 32
    assert storage_bytes([shard], per_tensor=True) == 20
    mixed = [torch.zeros(3, dtype=torch.float64), None, torch.zeros(2)]
    assert storage_bytes(mixed, per_tensor=True) == 32


def test_a_dtensor_counts_its_local_shard():
    fake_pg = pytest.importorskip("torch.testing._internal.distributed.fake_pg")
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    dist.init_process_group("fake", store=fake_pg.FakeStore(), rank=1, world_size=4)
    try:
        mesh = init_device_mesh("cpu", (4,))
        local = torch.zeros(3, 2)  # this rank's 3 of 12 rows
        d = DTensor.from_local(local, mesh, [Shard(0)], run_check=False)
        assert d.shape == (12, 2)
        assert storage_bytes([d]) == storage_bytes([d], per_tensor=True) == 24
        assert held_state_bytes([nn.Parameter(d)])["params"] == 24
    finally:
        dist.destroy_process_group()


def test_adam_step_counters_are_counted_apart():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))  # 4 tensors, 23 parameters
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    held = held_state_bytes(model.parameters(), opt)
    assert held == {"params": 92, "grads": 92, "optimizer": 2 * 92, "steps": 4 * 4}
    # held_bytes (lesson 09's StateBytes) keeps them with the optimizer's state.
    assert held_bytes(model, opt).__dict__ == {"params": 92, "grads": 92, "optimizer": 200}
