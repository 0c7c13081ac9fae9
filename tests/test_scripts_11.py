"""scripts/11_train.py as plain processes: a run killed mid-epoch (SIGKILL) and
resumed from a mid-epoch snapshot ends with the uninterrupted run's parameters.
The notebook runs the torchrun cases (a restart at an epoch boundary)."""

import pytest

from ddp_course import launch


def test_resume_mid_epoch_equals_the_uninterrupted_run(root, tmp_path):
    script = root / "scripts" / "11_train.py"
    args = ["--epochs", "1", "--max-steps", "30", "--snapshot-every", "10"]
    one_thread = {"OMP_NUM_THREADS": "1"}  # as torchrun sets it: no oversubscribed cores
    full = launch.python(script, [*args, "--snapshot", str(tmp_path / "a.pt")], results=True,
                         echo=False, timeout_s=120, env=one_thread).results  # fmt: skip
    snap = str(tmp_path / "b.pt")
    with pytest.raises(launch.LaunchError) as killed:
        launch.python(script, [*args, "--snapshot", snap, "--die-at-step", "25"], echo=False,
                      timeout_s=120, env=one_thread)  # fmt: skip
    assert killed.value.returncode == -9  # SIGKILL, no Python exception
    second_attempt = {**one_thread, "TORCHELASTIC_RESTART_COUNT": "1"}
    resumed = launch.python(script, [*args, "--snapshot", snap], results=True, echo=False,
                            env=second_attempt, timeout_s=120).results  # fmt: skip
    assert resumed["resumed_from"] == {"epoch": 0, "step": 20}  # the last snapshot, step 20
    assert resumed["restart_count"] == 1
    assert resumed["parameters_sha256"] == full["parameters_sha256"]
    assert resumed["history"] == full["history"]
