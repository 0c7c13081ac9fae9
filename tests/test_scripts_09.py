"""Lesson 09's scripts as one plain process, which the notebook does not run. Under
torchrun, notebook 09 asserts what they report under nbval: 09_zero.py on 1 to 4 ranks,
09_fsdp.py (ZeroRedundancyOptimizer and FSDP2 against DDP, reshard_after_forward, a
sharded checkpoint saved by 2 ranks and loaded by 2 and by 3). The scripts assert
equality with DDP themselves (assert_close)."""

import pathlib

from ddp_course import launch
from ddp_course.sharding import FP32_ADAM, state_bytes_per_rank

ROOT = pathlib.Path(__file__).resolve().parent.parent
FP32 = 4  # bytes per parameter and per gradient; Adam keeps two such values more
FSDP = ("FSDP2 reshard_after_forward=True", "FSDP2 reshard_after_forward=False")


def test_zero_script_as_plain_python(root):
    job = launch.python(root / "scripts/09_zero.py", ["--steps", "2", "--hidden", "32"],
                        results=True, echo=False, timeout_s=300)  # fmt: skip
    rows = job.results["rows"]
    assert [r["stage"] for r in rows] == [0, 1, 2, 3]
    for r in rows:
        psi = r["num_params"]
        held = r["per_rank"][0]["held"]
        # One rank holds everything: 4 + 4 + 8 bytes a parameter, + Adam's step counters.
        assert held == {"params": FP32 * psi, "grads": FP32 * psi,
                        "optimizer": 2 * FP32 * psi + 4 * r["param_tensors"]}  # fmt: skip
        assert r["formula"] == state_bytes_per_rank(r["stage"], psi, 1, FP32_ADAM).__dict__
        assert r["gap"] <= 1e-6
        # DDP all-reduces 2 Psi values (paper's units); stage 3 gathers once more: 3 Psi.
        assert r["sent_bytes"] == (3 if r["stage"] == 3 else 2) * FP32 * psi
