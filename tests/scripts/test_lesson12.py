"""Lesson 12's scripts where notebook 12 does not run them: every lab's fixed version under
torchrun (one job), and both scripts as one plain process. The broken labs fail under
nbval in the notebook, which also checks that they leave no process behind."""

import ast
import re
import time

import psutil
import pytest

from ddp_course.harness import launch

ALL_LABS = ["mismatch", "rank0_only", "unused", "shapes", "set_epoch", "divergent"]


def _alive(marker):
    return [
        p
        for p in psutil.process_iter(["cmdline"])
        if any(marker in part for part in p.info["cmdline"] or [])
    ]


def test_every_fixed_lab_passes_under_torchrun_and_leaves_nothing(root):
    job = launch.torchrun(
        root / "scripts/12_labs.py",
        ["--lab", *ALL_LABS, "--fixed"],
        nproc=2,
        results=True,
        echo=False,
        timeout_s=180,
    )
    labs = job.results["labs"]
    assert labs["mismatch"]["loss_sum"] == 1.0 + 2.0  # every rank's loss, summed
    assert labs["rank0_only"]["epochs"] == 2 and labs["unused"]["steps"] == 2
    assert labs["shapes"]["differ"] == {}
    assert labs["set_epoch"]["set_epoch"]["repeated"] == []
    assert labs["set_epoch"]["forgot set_epoch"]["repeated"] == [[0, 1], [0, 2], [1, 2]]
    assert labs["divergent"]["same seed"]["differ"] == {}
    time.sleep(0.5)
    assert _alive("12_labs.py") == []


def test_labs_as_one_plain_process(root):
    labs = [lab for lab in ALL_LABS if lab != "unused"]  # DDP's unused check fails at 1 rank too
    job = launch.python(
        root / "scripts/12_labs.py", ["--lab", *labs], results=True, echo=False, timeout_s=180
    )
    # One rank: nothing to mismatch, wait for or differ from, so these bugs pass.
    labs = job.results["labs"]
    assert job.results["world_size"] == 1 and labs["mismatch"]["loss_sum"] == 1.0
    assert labs["divergent"]["seed + rank"]["differ"] == {}
    assert labs["set_epoch"]["forgot set_epoch"]["repeated"] == [[0, 1], [0, 2], [1, 2]]


def test_monitor_as_one_plain_process(root, tmp_path):
    job = launch.python(
        root / "scripts/12_monitor.py",
        ["--steps", "3", "--profile-step", "1", "--tb-dir", str(tmp_path / "tb")],
        results=True,
        echo=False,
        timeout_s=180,
    )
    r = job.results
    assert r["world_size"] == 1 and r["stragglers"] == [] and len(r["ranks"][0]) == 3
    assert set(r["profiles"][0]["sections_ms"]) == {"data", "forward", "backward"}
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))


def test_monitored_barrier_runs_on_a_gloo_group(root):
    # monitored_barrier exists on gloo only: on nccl the default group would refuse it,
    # so every call names a group that the script creates with backend="gloo".
    tree = ast.parse((root / "scripts" / "12_labs.py").read_text())
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call)]

    def named(call, name):
        return getattr(call.func, "attr", getattr(call.func, "id", None)) == name

    barriers = [c for c in calls if named(c, "monitored_barrier")]
    groups = [c for c in calls if named(c, "new_group")]
    assert barriers and all(any(k.arg == "group" for k in c.keywords) for c in barriers)
    assert groups and all(
        any(k.arg == "backend" and ast.literal_eval(k.value) == "gloo" for k in c.keywords)
        for c in groups
    )


def test_the_monitored_lab_names_the_missing_rank(root):
    with pytest.raises(launch.LaunchError) as info:
        launch.torchrun(
            root / "scripts/12_labs.py",
            ["--lab", "rank0_only", "--monitored", "--timeout-s", "4"],
            nproc=2,
            echo=False,
            timeout_s=120,
        )
    assert re.search(r"Rank 1 failed to pass monitoredBarrier in \d+ ms", str(info.value.logs))
    time.sleep(0.5)
    assert _alive("12_labs.py") == []
