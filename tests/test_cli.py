"""The command line: environment check and the headless course runner."""

import nbformat

from ddp_course.__main__ import main


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
