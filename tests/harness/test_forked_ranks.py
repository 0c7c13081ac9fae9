"""Ranks forked from torchrun's agent (ddp_course.harness.forked_ranks): the script sees
what it sees as a new interpreter, failures and exit codes read the same, and the
ranks really start with torch imported."""

import re

import pytest

from ddp_course import runtime
from ddp_course.harness import forked_ranks, launch


def _views(workers, tmp_path, fork, *args):
    goodbye = tmp_path / f"atexit_{fork}.txt"
    job = launch.torchrun(
        workers / "rank_start_probe.py",
        ["--atexit-file", str(goodbye), *args],
        nproc=2,
        results=True,
        echo=False,
        gpus=0,
        fork_ranks=fork,
    )
    return job.results["views"], goodbye.read_text()


def test_a_forked_rank_sees_what_a_new_interpreter_sees(workers, tmp_path):
    forked, forked_goodbye = _views(workers, tmp_path, True)
    started, started_goodbye = _views(workers, tmp_path, False)
    # The one intended difference: the forked rank starts with torch imported.
    assert [v.pop("preloaded_at_start") for v in forked] == [True, True]
    assert [v.pop("preloaded_at_start") for v in started] == [False, False]
    # The script's arguments, but the two runs' files have different names.
    for view in forked + started:
        view.pop("agent_ancestors")  # tests/harness/test_agent_server.py
        argv = view.pop("argv")
        assert argv[0] == str(workers / "rank_start_probe.py") and argv[1::2] == [
            "--atexit-file",
            "--results",
        ]
    assert forked == started
    assert forked[0]["threads"] == 1 and forked[0]["omp_num_threads"] == "1"
    assert forked[0]["listening_at_start"] == []  # the agent's store is not rank 0's
    assert forked[0]["tempdir"] != "" and "ddp_course_" not in forked[0]["tempdir"]
    assert forked[1]["env"] == {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2"}
    assert forked[0]["agent_command"] == {"loopback": True, "script": True}
    assert sorted(forked_goodbye.splitlines()) == sorted(started_goodbye.splitlines())
    assert len(forked_goodbye.splitlines()) == 2


@pytest.mark.parametrize("fork", [True, False], ids=["forked", "new-interpreter"])
def test_a_failing_forked_rank_reads_as_a_failing_rank(workers, tmp_path, fork):
    with pytest.raises(launch.LaunchError) as caught:
        _views(workers, tmp_path, fork, "--fail")
    assert caught.value.rank == 1 and caught.value.returncode == 1
    # Printed as Python prints an uncaught exception: through torch's excepthook, which
    # names the rank on every line.
    log = caught.value.logs[1]
    assert re.search(r"^\[rank1\]: ValueError: deliberate failure on rank 1$", log, re.M), log
    assert re.search(r"rank_start_probe.py\", line \d+", caught.value.logs[1])
    with pytest.raises(launch.LaunchError) as caught:
        _views(workers, tmp_path, fork, "--exit", "3")
    # The exit code is torchrun's (1); its report names the rank's own.
    assert caught.value.rank == 1 and re.search(r"exitcode\s*: 3", caught.value.output)
    with pytest.raises(launch.LaunchError) as caught:
        _views(workers, tmp_path, fork, "--exit-message", "use the other script")
    assert caught.value.rank == 1 and "use the other script" in caught.value.logs[1]


def test_only_single_node_cpu_jobs_fork(workers, monkeypatch):
    with pytest.raises(ValueError, match="single-node job on the CPU"):
        launch.torchrun(
            workers / "rank_start_probe.py", env={"DDP_COURSE_DEVICE": "cuda"}, fork_ranks=True
        )
    monkeypatch.setenv("DDP_COURSE_FORK_RANKS", "yes")
    with pytest.raises(ValueError, match="DDP_COURSE_FORK_RANKS='yes'"):
        launch.torchrun(workers / "rank_start_probe.py", gpus=0)


def test_cpu_jobs_fork_unless_told_not_to(monkeypatch):
    monkeypatch.delenv(forked_ranks.FORK_ENV, raising=False)
    assert forked_ranks.enabled({})
    assert not forked_ranks.enabled({forked_ranks.FORK_ENV: "0"})
    monkeypatch.setenv(forked_ranks.FORK_ENV, "0")
    assert not forked_ranks.enabled({})


def test_no_rank_is_forked_on_a_machine_with_a_gpu(workers, monkeypatch):
    # A CPU fallback job on a GPU machine: its forked ranks could not use CUDA at all.
    monkeypatch.delenv(forked_ranks.FORK_ENV, raising=False)
    monkeypatch.setattr(runtime, "gpu_count", lambda: 1)
    assert not forked_ranks.enabled({})
    assert not launch._fork_ranks(None, {"DDP_COURSE_DEVICE": "cpu"}, single_node=True)
    with pytest.raises(ValueError, match="torch sees no GPU"):
        launch.torchrun(
            workers / "rank_start_probe.py", env={"DDP_COURSE_DEVICE": "cpu"}, fork_ranks=True
        )
