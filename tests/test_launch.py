"""launch: results, per-rank logs, failures named by rank, timeouts that kill all."""

import time

import psutil
import pytest

from ddp_course import launch


def _alive(marker: str) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        cmdline = proc.info["cmdline"] or []
        if any(marker in part for part in cmdline):
            found.append(proc)
    return found


def test_success_returns_results_and_every_rank_log(workers, capsys):
    job = launch.torchrun(workers / "fail_or_hang.py", nproc=2, results=True, timeout_s=120)
    assert job.results == {"world_size": 2}
    assert sorted(job.logs) == [0, 1]
    assert "worker rank 1 started" in job.logs[1]
    printed = capsys.readouterr().out
    assert "worker rank 0 started" in printed  # rank 0 streamed live
    assert "worker rank 1 started" not in printed  # others only in their logs
    assert "Setting OMP_NUM_THREADS" not in printed


def test_failure_names_the_failing_rank_and_leaves_nothing_behind(workers):
    start = time.perf_counter()
    with pytest.raises(launch.LaunchError) as info:
        launch.torchrun(workers / "fail_or_hang.py", ["--fail-rank", "1"], nproc=2,
                        timeout_s=120, echo=False)  # fmt: skip
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
    with pytest.raises(launch.LaunchTimeout, match="timeout"):
        launch.torchrun(workers / "fail_or_hang.py", ["--hang"], nproc=2, timeout_s=8,
                        echo=False)  # fmt: skip
    assert time.perf_counter() - start < 8 + 30
    time.sleep(0.5)
    assert _alive("fail_or_hang.py") == []


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
