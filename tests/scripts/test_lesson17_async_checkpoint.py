"""Lesson 17's 17_async_checkpoint.py on 2 ranks, with a small TinyGPT: a checkpoint written by
dcp.async_save holds the state at the call, not the state the loop changed it to while the
write went on; both kinds of save load back; and a rank killed during an async_save leaves the
last complete checkpoint loadable and the interrupted one without its .metadata, which
dcp.load refuses. No timings are asserted: the notebook shows them."""

import pathlib

import pytest

from ddp_course.harness import launch
from ddp_course.harness.jobs import processes_running

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "scripts/17_async_checkpoint.py"
SMALL = ["--d-model", "32", "--n-heads", "2", "--n-layers", "1", "--seq-len", "16"]


def test_async_save_writes_the_state_at_the_call_and_both_saves_load(tmp_path):
    args = ["--folder", str(tmp_path), "--repeats", "2", "--steps-during", "2", *SMALL]
    t = launch.torchrun(SCRIPT, args, nproc=2, results=True, echo=False).results["time"]
    n, during = t["tensors"], t["during"]
    assert n > 0 and t["state_bytes"] > 0
    # AdamW changed every tensor in place after async_save returned; the file has none of it.
    assert during["unchanged_by_steps"] == [0, 0]
    assert during["equal_to_state_at_call"] == [n, n]
    assert during["equal_to_state_after_update"] == during["equal_to_state_after_steps"] == [0, 0]
    for name in ("sync_0", "async_0"):
        loaded = t["loaded_equal"][name]
        assert loaded["after"] == [n, n] and max(loaded["before"]) < n, name
    # The ranks hold one replicated state: each tensor is written once, by one rank or the other.
    assert (
        t["files"]["sync_0"]
        == t["files"]["during"]
        == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    )
    assert all(t["state_bytes"] < b < 2 * t["state_bytes"] for b in t["checkpoint_bytes"].values())
    assert sorted(p.name for p in (tmp_path / "time").iterdir()) == ["async_0", "during", "sync_0"]


def test_a_kill_during_async_save_leaves_the_last_complete_checkpoint(tmp_path):
    args = ["--folder", str(tmp_path), *SMALL]
    with pytest.raises(launch.LaunchError) as crashed:
        launch.torchrun(SCRIPT, [*args, "--part", "crash"], nproc=2, echo=False)
    assert crashed.value.rank == 0 and "SIGKILL" in crashed.value.output
    assert (tmp_path / "crash/step_1/.metadata").exists()
    assert not (tmp_path / "crash/step_2/.metadata").exists()

    job = launch.torchrun(SCRIPT, [*args, "--part", "load"], nproc=2, results=True, echo=False)
    one, two = job.results["load"]["step_1"], job.results["load"]["step_2"]
    assert one["loaded"] and one["folder_exists"] and ".metadata" in one["files"]
    assert one["sha256_equal"] == [True, True] and one["sha256_equal_before"] == [False, False]
    assert not two["loaded"] and ".metadata" not in two["files"] and not two["sha256_beside"]
    assert two["error"].startswith("CheckpointException")
    assert sorted(two["causes"]) == ["0", "1"]
    assert all("metadata is None" in c and "/.metadata" in c for c in two["causes"].values())
    assert processes_running(str(tmp_path)) == []
