"""Exact distributed evaluation equals one process, for world sizes 2 and 3
(multi-process, through the launcher); the padded sampler does not. Also
lesson 06's scripts under torchrun."""

import math

import pytest
import torch

from ddp_course.data import load_mnist
from ddp_course.engine import evaluate
from ddp_course.launch import torchrun
from ddp_course.models import MLP, SmallCNN
from ddp_course.runtime import DistContext
from ddp_course.sampler import rank_indices


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


@pytest.fixture(scope="module")
def saved_cnn(tmp_path_factory):
    torch.manual_seed(1234)
    path = tmp_path_factory.mktemp("model") / "cnn.pt"
    torch.save(SmallCNN().state_dict(), path)
    return path


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


def test_samplers_script(root, saved_cnn):
    path = saved_cnn
    res = torchrun(
        root / "scripts" / "06_samplers.py",
        ["--dataset-size", "11", "--epochs", "2", "--seed", "4", "--eval-size", "101",
         "--checkpoint", str(path)],
        nproc=2, results=True, echo=False, timeout_s=180,
    ).results  # fmt: skip
    for rank, got in enumerate(res["indices"]):
        assert got["without_set_epoch"] == [rank_indices(11, 2, rank, seed=4, epoch=0)] * 2
        assert got["with_set_epoch"] == [rank_indices(11, 2, rank, seed=4, epoch=e)
                                         for e in range(2)]  # fmt: skip
    assert res["exact"]["samples"] == 101
    assert sum(len(p["correct"]) for p in res["padded"]) == 102
    seeds = res["seeds"]
    assert seeds[0]["init_same_seed"] == seeds[1]["init_same_seed"]
    assert seeds[0]["init_seed_plus_rank"] != seeds[1]["init_seed_plus_rank"]
    assert seeds[0]["init_seed_plus_rank_after_ddp"] == seeds[1]["init_seed_plus_rank_after_ddp"]
    assert seeds[0]["same_seed"] == seeds[1]["same_seed"]
    assert seeds[0]["seed_plus_rank"] != seeds[1]["seed_plus_rank"]


def test_uneven_inputs_finish_under_join(root):
    res = torchrun(
        root / "scripts" / "06_uneven_inputs.py",
        ["--join", "--batches", "2", "--extra", "2", "--timeout", "60"],
        nproc=2, results=True, echo=False, timeout_s=120,
    ).results  # fmt: skip
    ranks = res["ranks"]
    assert [r["steps"] for r in ranks] == [2, 4]
    assert ranks[0]["checksum"] == ranks[1]["checksum"]  # Join synced the final model
