"""Exact distributed evaluation equals one process, for world sizes 2 and 3
(multi-process, through the launcher); the padded sampler does not. Also
lesson 06's scripts under torchrun."""

import math

import pytest
import torch

from ddp_course.data import load_mnist
from ddp_course.harness.launch import torchrun
from ddp_course.models import MLP
from ddp_course.runtime import DistContext
from ddp_course.training import evaluate


@pytest.fixture(scope="module")
def saved_model(tmp_path_factory):
    """A seeded, untrained MLP on disk and its single-process evaluation."""
    torch.manual_seed(1234)
    model = MLP()
    path = tmp_path_factory.mktemp("model") / "mlp.pt"
    torch.save(model.state_dict(), path)
    test = load_mnist(train=False, source="subset").dataset
    assert len(test) == 1000
    return path, evaluate(model, test, DistContext(), batch_size=250)


@pytest.mark.parametrize("world_size", [2, 3])
def test_exact_evaluation_equals_one_process(workers, saved_model, world_size):
    path, single = saved_model
    job = torchrun(
        workers / "samplers_eval.py",
        ["--model", str(path)],
        nproc=world_size,
        results=True,
        echo=False,
        timeout_s=180,
    )
    res = job.results
    exact = res["exact"]
    assert exact["samples"] == single["samples"] == 1000
    # Correct counts are integers summed exactly: the accuracies are equal.
    assert exact["accuracy"] == single["accuracy"]
    torch.testing.assert_close(exact["loss"], single["loss"], rtol=1e-5, atol=1e-6)
    padded_samples = sum(p["samples"] for p in res["padded"])
    assert padded_samples == world_size * math.ceil(1000 / world_size)
    assert [p["samples"] for p in res["padded"]] == [math.ceil(1000 / world_size)] * world_size
    if 1000 % world_size:
        assert padded_samples > 1000  # the padded sampler counts repeats


# Lesson 06's scripts themselves (set_epoch, padding, seeds, uneven inputs with and
# without Join) are asserted by notebook 06 under nbval, at 2 and 3 ranks.
