"""DDP on 2 and 3 gloo ranks equals one process on the global batch; what breaks it."""

import pytest
import torch

from ddp_course import launch
from ddp_course.checkpoint import load_checkpoint
from ddp_course.engine import check_same_training, parameter_gap
from ddp_course.models import SmallCNN


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


# Lesson 05's claim, checked on the lesson's own script with plain SGD, whose
# step is lr x gradient: a gradient N times too large moves N times as far.
SGD_RUN = ["--epochs", "1", "--max-steps", "5", "--no-dropout", "--no-progress",
           "--optimizer", "sgd", "--lr", "0.1"]  # fmt: skip
TOLERANCE = 1e-4  # the notebook's: float rounding of a different summation order


def _trained(root, tmp_path, name, nproc, batch_size, *extra):
    ckpt = tmp_path / f"{name}.pt"
    args = [*SGD_RUN, "--batch-size", str(batch_size), "--checkpoint", str(ckpt), *extra]
    script = root / "scripts/05_train_ddp.py"
    if nproc == 1:
        launch.python(script, args, echo=False)
    else:
        launch.torchrun(script, args, nproc=nproc, echo=False)
    model = SmallCNN(dropout=False)
    load_checkpoint(ckpt, model)
    return model


def test_summing_allreduce_fails_the_lesson_05_check(root, tmp_path):
    torch.manual_seed(0)  # the script's seed: the weights before the first step
    initial = SmallCNN(dropout=False)
    one = _trained(root, tmp_path, "one", 1, 16)
    averaged = _trained(root, tmp_path, "mean", 2, 8)
    summed = _trained(root, tmp_path, "sum", 2, 8, "--grad-reduce", "sum")
    check_same_training(one, averaged, initial, atol=TOLERANCE)  # DDP as it is: passes
    with pytest.raises(AssertionError, match="did not take the same steps"):
        check_same_training(one, summed, initial, atol=TOLERANCE)
    assert parameter_gap(one, summed) > 100 * TOLERANCE  # by orders of magnitude


@pytest.mark.parametrize("nproc", [2, 3])
def test_what_breaks_the_equivalence(root, nproc):
    job = launch.torchrun(root / "scripts/05_what_breaks.py", nproc=nproc, results=True,
                          echo=False)  # fmt: skip
    cases = job.results["cases"]
    assert cases.pop("equal shares")["gap"] < 1e-6
    for name, case in cases.items():
        assert case["gap"] > 1e-3, name
    assert cases["uneven batches"]["rank_samples"] != 3 * 4  # the shares really differ
    # Padding: the ranks read one sample more than the data set holds.
    padded = cases["padded duplicates"]
    assert padded["global_samples"] == nproc * 4 * 3 - 1
