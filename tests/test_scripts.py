"""The lesson scripts of 00, 01 and 05, as python and under torchrun, tiny settings."""

import pytest

from ddp_course import launch

TINY = ["--epochs", "1", "--max-steps", "5", "--no-progress", "--batch-size", "16"]
RESULT_KEYS = {"world_size", "epochs", "train_loss", "test_accuracy", "test_samples",
               "samples_per_s", "wall_s"}  # fmt: skip


def test_hello_ranks_under_torchrun(root):
    job = launch.torchrun(root / "scripts/00_hello_ranks.py", nproc=2, results=True, echo=False)
    assert job.results["sum"] == 3 and job.results["backend"] == "gloo"
    assert "hello from rank 1 of 2" in job.logs[1]


def test_fail_on_rank_names_the_rank(root):
    with pytest.raises(launch.LaunchError) as info:
        launch.torchrun(root / "scripts/00_fail_on_rank.py", ["--rank", "0"], nproc=2,
                        echo=False, timeout_s=120)  # fmt: skip
    assert info.value.rank == 0


def test_train_single_as_python(root):
    job = launch.python(root / "scripts/01_train_single.py", TINY, results=True, echo=False)
    r = job.results
    assert RESULT_KEYS <= set(r)
    assert (r["world_size"], r["epochs"], r["test_samples"]) == (1, 1, 1000)
    assert r["history"][0]["train_samples"] == 5 * 16


def test_train_ddp_as_plain_python(root):
    job = launch.python(root / "scripts/05_train_ddp.py", TINY, results=True, echo=False)
    assert job.results["world_size"] == 1 and job.results["backend"] is None


def test_what_breaks_as_plain_python(root):
    job = launch.python(root / "scripts/05_what_breaks.py", results=True, echo=False)
    cases = job.results["cases"]
    assert len(cases) == 6 and all(c["gap"] == 0 for c in cases.values())  # one rank: all equal


def test_launcher_probe_under_torchrun_and_python(root):
    job = launch.torchrun(root / "scripts/05_local_rank.py", nproc=2, results=True, echo=False)
    assert job.results["local_rank"] == "0"
    assert {"LOCAL_RANK", "TORCHELASTIC_RUN_ID"} <= set(job.results["variables"])
    alone = launch.python(root / "scripts/05_local_rank.py", results=True, echo=False)
    assert alone.results["variables"] == [] and alone.results["local_rank"] is None
