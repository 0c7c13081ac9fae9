"""torchrun's agents, and plain one-process runs, forked from a warm server
(ddp_course.harness.agent_server): a served job runs as one started as a new
interpreter, jobs whose environment the server cannot give start as before, and the
server goes when its launcher goes."""

import os
import re
import subprocess
import sys
import time

import psutil
import pytest

from ddp_course.harness import agent_server, launch


def _views(workers, tmp_path, served, monkeypatch, env=None):
    monkeypatch.setenv(agent_server.SERVER_ENV, "1" if served else "0")
    goodbye = tmp_path / f"atexit_{served}.txt"
    job = launch.torchrun(
        workers / "rank_start_probe.py",
        ["--atexit-file", str(goodbye)],
        nproc=2,
        results=True,
        echo=False,
        gpus=0,
        env=env,
    )
    return job, job.results["views"]


def test_a_served_agent_runs_the_job_as_a_new_agent_would(workers, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the agent starts in the launcher's folder, not the server's
    served_job, served = _views(workers, tmp_path, True, monkeypatch)
    plain_job, plain = _views(workers, tmp_path, False, monkeypatch)
    # Agent -> waiter -> server for the served job; agent -> this process otherwise.
    assert {v.pop("agent_ancestors")[1] for v in served} == {launch._AGENTS.pid}
    assert {v.pop("agent_ancestors")[0] for v in plain} == {os.getpid()}
    for view in served + plain:
        view["argv"] = view["argv"][:2]  # the results files' names differ
    added = (
        [v.pop("added_since_agent") for v in served],
        [v.pop("added_since_agent") for v in plain],
    )
    assert added[0] == added[1], set(added[0][0]) ^ set(added[1][0])
    assert served == plain
    assert served[0]["cwd"] == str(tmp_path) and served[0]["device_env"] == "cpu"
    assert served[0]["agent_command"] == {"loopback": True, "script": True}
    # The job's variables are the agent's, as other processes read it: none "added" by it.
    assert "DDP_COURSE_DEVICE" not in added[0][0]
    assert {"RANK", "LOCAL_RANK", "WORLD_SIZE"} <= set(added[0][0])
    assert served[0]["preloaded_at_start"]
    # What the agent and its ranks used, reported by the server's waiter.
    assert served_job.cpu_s > 0 and plain_job.cpu_s is None


def _plain_view(workers, tmp_path, served, monkeypatch, args=()):
    monkeypatch.setenv(agent_server.SERVER_ENV, "1" if served else "0")
    goodbye = tmp_path / f"plain_atexit_{served}.txt"
    job = launch.python(
        workers / "rank_start_probe.py",
        ["--atexit-file", str(goodbye), "--on-rank", "0", *args],
        results=True,
        echo=False,
        gpus=0,
    )
    return job, job.results["views"][0], goodbye.read_text()


def test_a_served_plain_run_runs_as_a_new_interpreter(workers, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    served_job, served, served_goodbye = _plain_view(workers, tmp_path, True, monkeypatch)
    plain_job, plain, plain_goodbye = _plain_view(workers, tmp_path, False, monkeypatch)
    # The script's process: forked by the server's waiter, or this process's child.
    assert served.pop("agent_ancestors")[0] == launch._AGENTS.pid
    assert plain.pop("agent_ancestors")[0] == psutil.Process().parent().pid
    # Torch was imported before the script started only in the served run: what it saves.
    assert served.pop("preloaded_at_start") and not plain.pop("preloaded_at_start")
    # Its parent is the server's waiter or this process: what each reads differs.
    for view in (served, plain):
        del view["agent_command"], view["added_since_agent"]
        view["argv"] = view["argv"][:2]  # the results files' names differ
    assert served == plain
    assert served["cwd"] == str(tmp_path) and served["name"] == "__main__"
    assert served_goodbye == plain_goodbye == "rank 0 ran its atexit function\n"
    assert served_job.cpu_s is not None and plain_job.cpu_s is None


@pytest.mark.parametrize("served", [True, False], ids=["served", "new-interpreter"])
def test_a_failing_plain_run_reads_the_same_served_or_not(workers, tmp_path, monkeypatch, served):
    with pytest.raises(launch.LaunchError) as caught:
        _plain_view(workers, tmp_path, served, monkeypatch, ["--fail"])
    assert caught.value.returncode == 1
    assert re.search(r"^ValueError: deliberate failure on rank 0$", caught.value.output, re.M)
    assert caught.value.output.count("Traceback (most recent call last)") == 1
    # It starts in the script, as a new interpreter's does, not in the harness.
    first = re.search(r"most recent call last\):\n  File \"(.*?)\"", caught.value.output)
    assert first[1].endswith("rank_start_probe.py"), caught.value.output
    with pytest.raises(launch.LaunchError) as caught:
        _plain_view(workers, tmp_path, served, monkeypatch, ["--exit", "3"])
    assert caught.value.returncode == 3
    with pytest.raises(launch.LaunchError) as caught:
        _plain_view(workers, tmp_path, served, monkeypatch, ["--exit-message", "use another"])
    assert caught.value.returncode == 1
    assert caught.value.output.splitlines()[-1] == "use another"


def test_a_variable_read_at_import_gets_a_new_interpreter(workers, tmp_path, monkeypatch):
    _, served = _views(workers, tmp_path, True, monkeypatch)
    server = launch._AGENTS.pid
    assert served[0]["agent_ancestors"][1] == server
    _, views = _views(workers, tmp_path, True, monkeypatch, env={"TORCH_CPP_LOG_LEVEL": "ERROR"})
    assert views[0]["agent_ancestors"][0] == os.getpid()
    # A variable the ranks read only later is served.
    _, views = _views(workers, tmp_path, True, monkeypatch, env={"GLOO_SOCKET_IFNAME": "lo"})
    assert views[0]["agent_ancestors"][1] == server
    # pytest names the running test in the launcher's environment, anew for each test:
    # the same server serves them all.
    monkeypatch.setenv("PYTEST_CURRENT_TEST", "tests/another.py::test_another (call)")
    _, views = _views(workers, tmp_path, True, monkeypatch)
    assert views[0]["agent_ancestors"][1] == server
    # The launcher's own environment changed: a new server, the old one gone.
    monkeypatch.setenv("DDP_COURSE_TEST_UNRELATED", "1")
    monkeypatch.setenv("SOME_LIBRARY_SETTING", "1")
    _, views = _views(workers, tmp_path, True, monkeypatch)
    assert views[0]["agent_ancestors"][1] == launch._AGENTS.pid != server
    assert not psutil.pid_exists(server) or psutil.Process(server).status() == "zombie"


def test_servable_allows_only_variables_read_at_run_time():
    base = {"PATH": "/bin", "DDP_COURSE_DEVICE": "cpu"}
    assert agent_server.servable(base, {**base, "DDP_COURSE_DEVICE": "cuda"})
    assert agent_server.servable(base, {**base, "OMP_NUM_THREADS": "1"})
    assert not agent_server.servable(base, {**base, "TORCH_DISTRIBUTED_DEBUG": "DETAIL"})
    assert not agent_server.servable(base, {"DDP_COURSE_DEVICE": "cpu"})  # PATH dropped


def test_the_server_leaves_with_its_launcher(workers):
    code = (
        "from ddp_course.harness import launch\n"
        f"launch.torchrun({str(workers / 'launch_sleep.py')!r}, nproc=1, echo=False, gpus=0)\n"
        "print(launch._AGENTS.pid)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True
    )
    pid = int(done.stdout.split()[-1])
    deadline = time.monotonic() + 20
    while psutil.pid_exists(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not psutil.pid_exists(pid)


@pytest.mark.parametrize("argv", [["python", "-m", "x", "a/b.py"], ["python", "with space"]])
def test_a_process_can_show_another_command_line(argv):
    code = (
        "import sys, psutil\n"
        "from ddp_course.harness.agent_fork import set_command_line\n"
        f"assert set_command_line({argv!r})\n"
        "assert not set_command_line(['x' * 10000])\n"
        "print(repr([a for a in psutil.Process().cmdline() if a]))\n"
    )
    room = "-" * 1000  # as the server reserves room for its agents' command lines
    done = subprocess.run(
        [sys.executable, "-c", code, room], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == repr(argv)


def test_an_agent_that_cannot_start_fails_and_says_why(monkeypatch):
    # The agent's folder is gone by the time it starts: it must fail, never exit 0.
    server = agent_server.AgentServer({**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        command = [
            sys.executable,
            "-m",
            "ddp_course.harness.loopback",
            "--nproc_per_node=1",
            "no_such_script.py",
        ]
        monkeypatch.setattr(os, "getcwd", lambda: "/no/such/folder")
        job = server.start(command, dict(os.environ))
        monkeypatch.undo()
        assert job.wait(timeout=60) == 1
        assert "FileNotFoundError" in job.stdout.read()
    finally:
        server.close()
