"""Lesson 13's FSDP x TP layout on 4 gloo ranks against one process, and three mistakes
that a wrong mesh dimension or a wrong loss scale makes: each must move the parameters
away from one process's. Pipeline stages with tensor parallelism (pp 2 x tp 2) against
one process, with their collectives against the formula. The correct layouts all run in
tests/scripts/test_lesson13.py. MeshModel.evaluate, on PyTorch's fake process group (one
process): FSDP2 sharded again after a forward with no backward.
"""

import pytest
import worker_jobs

TOL = 1e-10  # float64, 3 SGD steps: the layouts differ by summation order only (~1e-16)


job = worker_jobs.worker_fixture("gpt_layouts_check.py", ["--steps", "3"], world_sizes=[4])


def test_fsdp_x_tp_equals_one_process(job):
    assert job["moved"] > 0.1  # the steps change the weights: equality is not trivial
    assert job["gaps"]["as written"] <= TOL


@pytest.mark.parametrize(
    "mistake", ["data by tp coordinate", "loss summed over dp", "fsdp over tp"]
)
def test_mistake_is_caught(job, mistake):
    assert job["gaps"][mistake] > 1e-3, mistake


def test_pipeline_with_tensor_parallelism_equals_one_process(job):
    # Each stage's ranks hold their stage's parameters, equal to one process's; the two
    # stages together hold them all. The loss inside the pipeline is the plain one on
    # gathered logits: loss_parallel()'s backward would run outside its context manager.
    by_rank = job["pp x tp"]
    for rank, r in enumerate(by_rank):
        assert r["gap"] <= TOL, (rank, r["gap"])
        assert r["counts"] == r["formula"], (rank, r["counts"])
    assert by_rank[0]["names"] == by_rank[1]["names"] != by_rank[2]["names"]
    assert set(by_rank[0]["names"]) | set(by_rank[2]["names"]) == set(job["all_names"])
    assert by_rank[3]["counts"]["step"]["all_gather tp"] == 2  # the logits, per micro-batch


def test_bad_sizes_are_refused_with_what_to_do(job):
    assert "the job has 4" in job["errors"]["world size"]
    assert "does not divide the 2 attention heads" in job["errors"]["tp > heads"]


def test_evaluate_leaves_every_fsdp_parameter_sharded():
    # FSDP2 keeps the root gathered after forward until its backward; evaluate has no
    # backward, so it reshards: otherwise the root's parameters stay plain whole tensors
    # and the next step skips their all-gather.
    fake_pg = pytest.importorskip("torch.testing._internal.distributed.fake_pg")
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from ddp_course import mesh_layouts as ml
    from ddp_course.mesh_model import MeshModel
    from ddp_course.models import TinyGPT

    dist.init_process_group("fake", store=fake_pg.FakeStore(), rank=0, world_size=4)
    try:
        lay = ml.layout("fsdp", 4)
        torch.manual_seed(0)
        model = TinyGPT(d_model=16, n_heads=4, n_layers=2, seq_len=16)
        mm = MeshModel(model, lay, ml.build_mesh(lay, "cpu"))
        x = torch.randint(256, (2, 16))
        mm.evaluate(x, x)
        assert all(isinstance(p, DTensor) for p in mm.module.parameters())
        assert mm.module.training  # back in training mode
    finally:
        dist.destroy_process_group()
