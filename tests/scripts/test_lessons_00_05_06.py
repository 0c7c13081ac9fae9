"""The lesson scripts of 00, 05 and 06 where the notebooks do not run them: as plain
python, and a failing rank named. Notebooks 00, 01, 05 and 06 assert their torchrun and
python runs."""

import pytest

from ddp_course.harness import launch
from ddp_course.harness.failures import torchrun_summary

TINY = ["--epochs", "1", "--max-steps", "5", "--no-progress", "--batch-size", "16"]
RESULT_KEYS = {
    "world_size",
    "epochs",
    "train_loss",
    "test_accuracy",
    "test_samples",
    "samples_per_s",
    "wall_s",
}


def test_fail_on_rank_names_the_rank(root, capsys):
    # echo=True: torchrun's own summary is printed too; the error keeps it as well
    # (LaunchError.output), where notebook 00's exercise 3 reads it.
    with pytest.raises(launch.LaunchError) as info:
        launch.torchrun(
            root / "scripts/00_fail_on_rank.py", ["--rank", "0"], nproc=2, echo=True, timeout_s=120
        )
    assert info.value.rank == 0
    blamed, times = torchrun_summary(capsys.readouterr().out)
    # Rank 0 fails first, so torchrun lists it first and names it even on a tie in seconds.
    assert blamed == 0 and 0 in times, (blamed, times)
    assert torchrun_summary(info.value.output) == (blamed, times)


def test_train_ddp_as_plain_python(root):
    # In float64, as notebook 05's equivalence check runs it (float32: the training run).
    args = [*TINY, "--float64"]
    job = launch.python(root / "scripts/05_train_ddp.py", args, results=True, echo=False)
    assert job.results["world_size"] == 1 and job.results["backend"] is None
    assert job.results["dtype"] == "torch.float64"


def test_what_breaks_as_plain_python(root):
    job = launch.python(root / "scripts/05_what_breaks.py", results=True, echo=False)
    cases = job.results["cases"]
    assert len(cases) == 6 and all(c["gap"] == 0 for c in cases.values())  # one rank: all equal


def test_launcher_probe_as_python(root):
    # Under torchrun, notebook 05 asserts what it reports.
    alone = launch.python(root / "scripts/05_local_rank.py", results=True, echo=False)
    assert alone.results["variables"] == [] and alone.results["local_rank"] is None


def test_uneven_inputs_as_plain_python(root):
    # One rank: nothing is uneven and nothing waits (no store, no collective).
    job = launch.python(root / "scripts/06_uneven_inputs.py", results=True, echo=False)
    assert job.results["ranks"] == [{"steps": 4, "checksum": job.results["ranks"][0]["checksum"]}]
    assert "finished its 4 steps" in job.output
