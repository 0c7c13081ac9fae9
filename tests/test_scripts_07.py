"""Lesson 07's scripts with tiny settings: each as one plain process, and under
torchrun where the notebook does not already run them that way (the
benchmark, and the deliberate unused-parameter failure)."""

import pytest

from ddp_course import launch

PLAIN = {
    "07_ddp_from_scratch.py": ["--steps", "1", "--width", "32", "--layers", "2", "--accum", "2",
                               "--batch-size", "4"],
    "07_ddp_knobs.py": ["--steps", "1", "--mem-width", "64"],
    "07_sync_batchnorm.py": [],
    "07_mixed_precision.py": ["--max-steps", "5"],
    "07_lr_scaling.py": ["--batch-size", "64"],
    "07_benchmark.py": ["--model", "layerstack", "--batch-size", "4", "--repeats", "2",
                        "--warmup", "1", "--caps", "0.25", "1", "--no-progress"],
}  # fmt: skip


@pytest.mark.parametrize("script", sorted(PLAIN))
def test_lesson07_script_as_plain_python(root, tmp_path, script):
    # The scripts assert their own claims (assert_close against torch or a
    # single process); a plain run is a group of one, so it checks the code
    # path a learner runs first.
    args = list(PLAIN[script])
    if script == "07_benchmark.py":
        args += ["--results", str(tmp_path / "bench.json")]
        job = launch.python(root / "scripts" / script, args, echo=False, timeout_s=300)
        assert (tmp_path / "bench.png").exists()
    else:
        job = launch.python(root / "scripts" / script, args, results=True, echo=False,
                            timeout_s=300)  # fmt: skip
        assert job.results


def test_lesson07_benchmark_under_torchrun(root, tmp_path):
    out = tmp_path / "bench.json"
    launch.torchrun(root / "scripts/07_benchmark.py", [*PLAIN["07_benchmark.py"], "--results",
                    str(out)], nproc=2, echo=False, timeout_s=300)  # fmt: skip
    assert out.exists() and out.with_suffix(".png").exists()


def test_lesson07_unused_parameter_error_is_torchs(root):
    with pytest.raises(launch.LaunchError) as info:
        launch.torchrun(root / "scripts/07_ddp_knobs.py", ["--unused-error"], nproc=2,
                        echo=False, timeout_s=180)  # fmt: skip
    text = "".join(info.value.logs.values())
    assert "Expected to have finished reduction" in text
