"""DDP on 2 and 3 gloo ranks equals one process on the global batch."""

import pytest

from ddp_course import launch


@pytest.mark.parametrize("nproc", [2, 3])
def test_ddp_matches_single_process_step_by_step(workers, nproc):
    job = launch.torchrun(workers / "ddp_equivalence.py", ["--steps", "5"], nproc=nproc,
                          results=True, echo=False, timeout_s=180)  # fmt: skip
    r = job.results
    assert r["world_size"] == nproc
    assert r["broadcast_ok"], "DDP did not broadcast rank 0's parameters"
    assert r["max_diff"] < 1e-5
    # Every rank reports the same exact evaluation, equal to one process.
    assert all(e == r["eval_per_rank"][0] for e in r["eval_per_rank"])
    dist_eval, single = r["eval_per_rank"][0], r["eval_single"]
    assert dist_eval["samples"] == single["samples"] == 53
    assert dist_eval["accuracy"] == pytest.approx(single["accuracy"])
    assert dist_eval["loss"] == pytest.approx(single["loss"], rel=1e-6)
