"""launch: results, per-rank logs, failures named by rank, timeouts that kill all."""

import ipaddress
import re
import tempfile
import threading
import time

import psutil
import pytest

from ddp_course.harness import jobs, launch, ports


def _alive(marker: str) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        cmdline = proc.info["cmdline"] or []
        if any(marker in part for part in cmdline):
            found.append(proc)
    return found


def test_success_returns_results_and_every_rank_log(workers, capsys):
    job = launch.torchrun(workers / "fail_or_hang.py", nproc=2, results=True, timeout_s=120)
    assert job.results["world_size"] == 2 and job.results["meta"]["world_size"] == 2
    assert sorted(job.logs) == [0, 1]
    assert "worker rank 1 started" in job.logs[1]
    printed = capsys.readouterr().out
    assert "worker rank 0 started" in printed  # rank 0 streamed live
    assert "worker rank 1 started" not in printed  # others only in their logs
    assert "Setting OMP_NUM_THREADS" not in printed


def test_failure_names_the_failing_rank_and_leaves_nothing_behind(workers):
    start = time.perf_counter()
    with pytest.raises(launch.LaunchError) as info:
        launch.torchrun(
            workers / "fail_or_hang.py", ["--fail-rank", "1"], nproc=2, timeout_s=120, echo=False
        )
    assert time.perf_counter() - start < 120
    error = info.value
    assert not isinstance(error, launch.LaunchTimeout)
    assert error.rank == 1
    assert "failed on rank 1" in str(error)
    assert "ValueError: deliberate failure on rank 1" in str(error)
    assert error.returncode != 0
    time.sleep(0.5)
    assert _alive("fail_or_hang.py") == []


def test_timeout_kills_every_rank(workers):
    start = time.perf_counter()
    with pytest.raises(launch.LaunchTimeout, match="timeout") as caught:
        # Both ranks must have imported torch and met before the timeout, also
        # while another test loads the cores (12 s was too short at load 15).
        launch.torchrun(workers / "fail_or_hang.py", ["--hang"], nproc=2, timeout_s=25, echo=False)
    assert time.perf_counter() - start < 25 + 30
    time.sleep(0.5)
    assert _alive("fail_or_hang.py") == []
    # Each rank's Python stack at the moment it was stopped names its collective.
    message = str(caught.value)
    assert re.search(r"rank 0: in all_reduce .*fail_or_hang.py:\d+: dist.all_reduce", message)
    assert re.search(r"rank 1: in recv .*fail_or_hang.py:\d+: dist.recv", message)


def test_free_port_is_outside_the_ephemeral_range():
    # A client's retries draw source ports from the ephemeral range; a store
    # port there can be drawn too, and the client then connects to itself.
    drawn = {launch.free_port() for _ in range(20)}
    assert not drawn & set(ports.ephemeral_ports()), drawn


def test_missing_script_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="no script"):
        launch.torchrun(tmp_path / "nope.py")
    with pytest.raises(ValueError, match="nproc"):
        launch.torchrun(__file__, nproc=0)


def test_script_without_results_file_is_an_error(tmp_path):
    script = tmp_path / "quiet.py"
    script.write_text("import sys\n")
    with pytest.raises(launch.LaunchError, match="wrote no --results"):
        launch.python(script, results=True, echo=False)


def test_python_runner_reports_the_exception(tmp_path):
    script = tmp_path / "boom.py"
    script.write_text("raise KeyError('missing')\n")
    with pytest.raises(launch.LaunchError, match="KeyError: 'missing'"):
        launch.python(script, echo=False)


def test_free_port_is_bindable():
    import socket

    port = launch.free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


def test_workers_that_ignore_sigterm_are_killed_after_a_timeout(workers):
    marker = "launch_ignore_sigterm.py"
    try:
        with pytest.raises(launch.LaunchTimeout):
            launch.torchrun(workers / marker, nproc=2, timeout_s=10, echo=False)
        time.sleep(0.5)
        assert _alive(marker) == []
    finally:
        for proc in _alive(marker):  # leave nothing behind even when the test fails
            proc.kill()


def _listening(procs: list[psutil.Process]) -> dict[int, list[str]]:
    found = {}
    for proc in procs:
        found[proc.pid] = [
            c.laddr.ip for c in proc.net_connections("inet") if c.status == psutil.CONN_LISTEN
        ]
    return found


def test_a_single_node_job_listens_on_loopback_only(workers, tmp_path):
    ready = tmp_path / "ready"
    ready.mkdir()
    job = {}
    run = threading.Thread(
        target=lambda: job.update(
            result=launch.torchrun(
                workers / "launch_sleep.py",
                ["--sleep", "5", "--ready-dir", str(ready)],
                nproc=2,
                timeout_s=120,
                echo=False,
            )
        )
    )
    run.start()
    deadline = time.monotonic() + 100
    while len(list(ready.iterdir())) < 2 and run.is_alive() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert len(list(ready.iterdir())) == 2, "the job did not start"
    ranks = [psutil.Process(int(f.read_text())) for f in ready.iterdir()]
    (agent,) = {rank.parent() for rank in ranks}  # torchrun's agent
    listening = _listening([agent, *agent.children(recursive=True)])
    run.join()
    assert "result" in job
    # The agent hosts the rendezvous store and the workers' store; gloo listens in
    # every worker. None of them may listen on 0.0.0.0, :: or a real interface.
    assert len(listening[agent.pid]) >= 1
    assert sum(map(len, listening.values())) >= 3, listening
    for pid, addresses in listening.items():
        for address in addresses:
            assert ipaddress.ip_address(address).is_loopback, (pid, address)


def test_nothing_is_left_in_the_temporary_directory(workers, tmp_path, monkeypatch):
    system_tmp = tmp_path / "tmp"
    system_tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(system_tmp))  # for torchrun's agent and the workers
    monkeypatch.setattr(tempfile, "tempdir", str(system_tmp))  # for the launcher
    job = launch.torchrun(
        workers / "launch_sleep.py", nproc=1, timeout_s=120, echo=False, results=True
    )
    assert list(system_tmp.iterdir()) == []
    # gloo is pinned to the loopback interface too (here it would pick 127.0.0.1
    # anyway, since this machine's hostname resolves there; not on every laptop).
    assert job.results["gloo_ifname"] == launch.loopback_interface() is not None


def test_restarts_still_rendezvous_on_loopback(workers):
    job = launch.torchrun(
        workers / "launch_restart.py",
        nproc=2,
        results=True,
        timeout_s=180,
        echo=False,
        extra_torchrun_args=["--max-restarts=1"],
    )
    assert {k: v for k, v in job.results.items() if k != "meta"} == {
        "attempt": 1,
        "sum_of_ranks_plus_one": 3.0,
    }


def test_the_job_is_announced_as_a_learner_would_type_it(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts" / "hello.py").write_text("print('hello')\n")
    launch.python("scripts/hello.py", ["--epochs", "1"], echo=False)
    launch.python(tmp_path / "scripts" / "hello.py", echo=False)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "$ python scripts/hello.py --epochs 1"
    assert re.fullmatch(r"hello\.py finished in \d+\.\d s", lines[1])
    assert lines[2] == "$ python scripts/hello.py"  # absolute paths shown relative


def test_a_device_the_caller_sets_is_shown_in_the_command(tmp_path, monkeypatch, capsys):
    # The command printed is what a learner would type: a job forced onto the CPU must say
    # so, or the same command on a machine with GPUs runs on them.
    monkeypatch.delenv(launch.DEVICE_ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "hello.py").write_text("print('hello')\n")
    env, prefix = launch.planned_env({launch.DEVICE_ENV: "cpu"}, nproc=2, gpus=4)
    assert (env[launch.DEVICE_ENV], prefix) == ("cpu", "DDP_COURSE_DEVICE=cpu ")
    assert launch.planned_env(None, nproc=2, gpus=0) == ({launch.DEVICE_ENV: "cpu"}, "")
    launch.python("hello.py", echo=False, env={launch.DEVICE_ENV: "cpu"}, gpus=0)
    assert capsys.readouterr().out.splitlines()[0] == "$ DDP_COURSE_DEVICE=cpu python hello.py"
    # One inherited from this process's environment is the learner's shell's: not repeated.
    monkeypatch.setenv(launch.DEVICE_ENV, "cpu")
    assert launch.planned_env(None, nproc=2, gpus=4) == ({}, "")


def test_torchrun_announcement_hides_the_launchers_own_flags(workers, capsys):
    launch.torchrun(
        workers / "launch_sleep.py",
        nproc=2,
        timeout_s=120,
        echo=False,
        extra_torchrun_args=["--max-restarts=0"],
    )
    lines = capsys.readouterr().out.splitlines()
    assert re.fullmatch(
        r"\$ torchrun --nproc_per_node=2 --max-restarts=0 (\S+/)?launch_sleep\.py", lines[0]
    )
    assert not [word for word in lines[0].split() if word.startswith("/")]  # no machine paths
    assert lines[-1].startswith("launch_sleep.py finished in ")
    for line in lines[1:-1]:  # echo=False: nothing else but "still running" lines
        assert re.fullmatch(r"  \.\.\. launch_sleep\.py still running, \d+ s", line)


def test_a_silent_job_says_it_is_still_running(tmp_path, monkeypatch, capsys):
    script = tmp_path / "slow.py"
    script.write_text("import time\ntime.sleep(2.5)\nprint('never shown')\n")
    monkeypatch.setattr(jobs, "HEARTBEAT_S", 1.0)
    monkeypatch.delenv(launch.HEARTBEAT_ENV, raising=False)
    launch.python(script, echo=False)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "$ python slow.py"
    assert re.fullmatch(r"slow\.py finished in \d+\.\d s", lines[-1])
    beats = lines[1:-1]
    assert len(beats) >= 2 and all(
        re.fullmatch(r"  \.\.\. slow\.py still running, \d+ s", b) for b in beats
    )
    assert "never shown" not in "\n".join(lines)


def test_heartbeat_lines_can_be_turned_off(tmp_path, monkeypatch, capsys):
    # What ``python -m ddp_course execute`` does, so stored outputs hold no such lines.
    script = tmp_path / "slow.py"
    script.write_text("import time\ntime.sleep(1.5)\n")
    monkeypatch.setattr(launch, "HEARTBEAT_S", 0.5)
    monkeypatch.setenv(launch.HEARTBEAT_ENV, "0")
    launch.python(script, echo=False)
    lines = capsys.readouterr().out.splitlines()
    assert [line for line in lines if "still running" not in line] == lines and len(lines) == 2
    monkeypatch.setenv(launch.HEARTBEAT_ENV, "soon")
    with pytest.raises(ValueError, match="not a number of seconds"):
        launch.python(script, echo=False)
