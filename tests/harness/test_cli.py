"""The command line: environment check and the headless course runner."""

import platform

import nbformat
import pytest

from ddp_course.harness.cli import KERNELSPEC, main


def _notebook(path, source):
    nbformat.write(nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(source)]), path)


def test_check_passes_here(capsys):
    assert main(["check"]) == 0
    out = capsys.readouterr().out
    assert "torchvision" in out and "backend" in out and "MNIST" in out


def test_course_runs_in_order_writes_copies_and_reports_failures(tmp_path, capsys):
    good, bad = tmp_path / "01_good.ipynb", tmp_path / "02_bad.ipynb"
    _notebook(good, "print('fine')")
    _notebook(bad, "assert 1 == 2, 'one is not two'")
    out_dir = tmp_path / "build"
    assert main(["course", str(good), str(bad), "--out", str(out_dir)]) == 1
    report = capsys.readouterr().out
    assert "01_good.ipynb" in report and "passed" in report
    assert "FAILED: CellExecutionError: AssertionError: one is not two" in report
    assert "1 passed, 1 failed" in report
    executed = nbformat.read(out_dir / "01_good.ipynb", as_version=4)
    assert executed.cells[0].outputs[0]["text"] == "fine\n"
    assert nbformat.read(good, as_version=4).cells[0].outputs == []  # original untouched
    assert (out_dir / "02_bad.ipynb").exists()  # kept up to the failing cell


@pytest.mark.parametrize("curve", [True, False], ids=["curve-keys", "no-curve"])
def test_executed_notebooks_carry_jupyterlabs_metadata_and_no_kernel_warning(
    tmp_path, capfd, monkeypatch, curve
):
    if not curve:  # pyzmq built without CurveZMQ: the fallback keeps the bar clean too
        monkeypatch.setattr("zmq.has", lambda capability: False)
    # JupyterLab rewrites a notebook whose kernelspec differs from the installed one,
    # which marks it modified as soon as it is opened.
    path = tmp_path / "01_meta.ipynb"
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("1 + 1")])
    nb.metadata["kernelspec"] = {
        "display_name": "Python 3",
        "language": "python",
        "name": "python3",
    }
    nbformat.write(nb, path)
    assert main(["execute", str(path)]) == 0
    metadata = nbformat.read(path, as_version=4).metadata
    assert metadata["kernelspec"] == KERNELSPEC
    assert metadata["language_info"]["name"] == "python"
    assert metadata["language_info"]["version"] == platform.python_version()
    # The kernel's stderr is this process's: its TCP warning would land in the bar.
    captured = capfd.readouterr()
    assert "without encryption" not in captured.err + captured.out


def test_kernelspec_is_the_installed_kernels():
    from jupyter_client.kernelspec import KernelSpecManager

    spec = KernelSpecManager().get_kernel_spec(KERNELSPEC["name"])
    assert {"display_name": spec.display_name, "language": spec.language} == {
        k: KERNELSPEC[k] for k in ("display_name", "language")
    }


def test_stored_outputs_hold_no_still_running_lines(tmp_path, monkeypatch):
    # `execute` stores outputs: the kernel runs with the launcher's heartbeat off.
    # setenv first, so that the value `execute` sets is undone after the test too
    monkeypatch.setenv("DDP_COURSE_HEARTBEAT_S", "10")
    monkeypatch.delenv("DDP_COURSE_HEARTBEAT_S")
    path = tmp_path / "01_beat.ipynb"
    code = "import os\nprint(os.environ.get('DDP_COURSE_HEARTBEAT_S'))"
    nbformat.write(nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(code)]), path)
    assert main(["execute", str(path)]) == 0
    assert nbformat.read(path, as_version=4).cells[0].outputs[0]["text"] == "0\n"


# ---------------------------------------------------------------- gpu-check's arguments


def test_gpu_check_arguments_reach_the_run(monkeypatch):
    from ddp_course.harness import gpu_check

    calls = []
    monkeypatch.setattr(gpu_check, "gpu_check", lambda *a, **k: calls.append((a, k)) or 3)
    monkeypatch.setattr(gpu_check, "dry_run", lambda *a: calls.append(a) or 0)
    assert main(["gpu-check", "--budget-s", "900", "--all", "--no-notebooks"]) == 3
    (args, kwargs) = calls.pop()
    assert args[0] == 900 and args[2] is False and kwargs["run_all"] is True
    assert kwargs["command"] == (
        "python -m ddp_course gpu-check --budget-s 900 --no-notebooks --all"
    )
    assert main(["gpu-check"]) == 3
    (args, kwargs) = calls.pop()
    assert args[0] is None and kwargs["command"] == "python -m ddp_course gpu-check"
    assert main(["gpu-check", "--dry-run"]) == 0
    assert calls.pop() == ((1, 2, 4), None, False)
    assert main(["gpu-check", "--dry-run", "--gpus", "4", "--budget-s", "60", "--all"]) == 0
    assert calls.pop() == ((4,), 60, True)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["gpu-check", "--gpus", "2"], "--gpus only goes with --dry-run"),
        (["gpu-check", "--dry-run", "--gpus", "0"], "must be at least 1"),
    ],
)
def test_gpu_check_refuses_a_gpu_count_it_cannot_use(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2 and message in capsys.readouterr().err
