"""Lesson 09's scripts as one plain process, which the notebook does not run. Under
torchrun, notebook 09 asserts what they report under nbval: 09_zero.py on 1 to 4 ranks
with Adam and with SGD, 09_fsdp.py (ZeroRedundancyOptimizer and FSDP2 against DDP,
their bytes per step, reshard_after_forward, a sharded checkpoint saved by 2 ranks and
loaded by 2 and by 3). The scripts assert equality with DDP themselves (assert_close)."""

import torch

from ddp_course.harness import launch
from ddp_course.models import MLP
from ddp_course.sharding import FP32_ADAM, FP32_SGD, state_bytes_per_rank

FP32 = 4  # bytes per parameter and per gradient; Adam keeps two such values more


def test_zero_script_as_plain_python(root):
    # 3 steps: the last one is a steady one (DDP's second forward broadcasts its bucket order).
    # Both optimizers in one process, each at its default learning rate.
    job = launch.python(
        root / "scripts/09_zero.py",
        ["--steps", "3", "--hidden", "32", "--optimizer", "adam", "sgd"],
        results=True,
        echo=False,
        timeout_s=300,
    )
    assert job.results["optimizers"] == ["adam", "sgd"]
    rows = job.results["rows"]
    assert [(r["optimizer"], r["stage"]) for r in rows] == [
        (optimizer, stage) for optimizer in ("adam", "sgd") for stage in range(4)
    ]
    assert {r["optimizer"]: r["lr"] for r in rows} == {"adam": 1e-3, "sgd": 0.1}
    layers = [
        FP32 * sum(p.numel() for p in m.parameters())
        for m in MLP(hidden=32).modules()
        if isinstance(m, torch.nn.Linear)
    ]
    for r in rows:
        optimizer, psi = r["optimizer"], r["num_params"]
        held = r["per_rank"][0]["held"]
        # One rank holds everything: 4 + 4 bytes a parameter, Adam 8 more + its step counters.
        optim = 2 * FP32 * psi + 4 * r["param_tensors"] if optimizer == "adam" else 0
        assert held == {"params": FP32 * psi, "grads": FP32 * psi, "optimizer": optim}
        per_value = FP32_ADAM if optimizer == "adam" else FP32_SGD
        assert r["formula"] == state_bytes_per_rank(r["stage"], psi, 1, per_value).__dict__
        assert r["gap"] <= 1e-6 < 1e-4 < r["moved"]
        # DDP all-reduces 2 Psi values (paper's units); stage 3 gathers once more: 3 Psi.
        assert r["sent_bytes"] == (3 if r["stage"] == 3 else 2) * FP32 * psi
        # What torch's dispatcher saw; one rank pads nothing, so it equals the log call by call.
        if r["stage"] == 0:
            assert {op for op, _ in r["torch_calls"]} == {"all_reduce"}
            assert sum(b for _, b in r["torch_calls"]) == FP32 * psi
        else:
            assert r["torch_calls"] == r["logged_calls"]
        # Stage 3 holds the full parameters of one layer at a time.
        want_peak = max(layers) if r["stage"] == 3 else None
        assert r["peak_gathered_bytes"] == want_peak
