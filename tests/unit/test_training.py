"""training and checkpoint in one process; ``training.check_same_training``, the check of
lesson 05, on models built by hand."""

import os
import pathlib
import stat

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from ddp_course import checkpoint, training
from ddp_course.models import MLP
from ddp_course.runtime import DistContext
from ddp_course.training import check_same_training, parameter_gap

CTX = DistContext()


def _data(n=50):
    gen = torch.Generator().manual_seed(0)
    return TensorDataset(
        torch.randn(n, 784, generator=gen), torch.randint(0, 10, (n,), generator=gen)
    )


def test_evaluate_counts_every_sample_once():
    torch.manual_seed(0)
    model, dataset = MLP(), _data(53)
    result = training.evaluate(model, dataset, CTX, batch_size=8)
    x, y = dataset.tensors
    with torch.no_grad():
        logits = model(x)
    assert result["samples"] == 53
    assert result["accuracy"] == pytest.approx((logits.argmax(1) == y).float().mean().item())
    assert result["loss"] == pytest.approx(nn.functional.cross_entropy(logits, y).item(), rel=1e-5)


def test_shard_indices_partition_without_padding():
    for n in (0, 1, 10, 11):
        for world in (1, 2, 3):
            shards = [list(training.shard_indices(n, r, world)) for r in range(world)]
            assert sorted(sum(shards, [])) == list(range(n))


def test_train_one_epoch_reduces_loss_and_counts_samples():
    torch.manual_seed(0)
    model = MLP()
    loader = DataLoader(_data(64), batch_size=16)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    first = training.train_one_epoch(model, loader, opt, CTX, progress=False)
    for _ in range(5):
        last = training.train_one_epoch(model, loader, opt, CTX, progress=False)
    assert first.samples == 64 and last.loss < first.loss
    capped = training.train_one_epoch(model, loader, opt, CTX, max_steps=2, progress=False)
    assert capped.samples == 32


def test_train_config_flags():
    cfg = training.TrainConfig.from_args(["--epochs", "2", "--batch-size", "8", "--no-dropout"])
    assert (cfg.epochs, cfg.batch_size, cfg.dropout, cfg.checkpoint) == (2, 8, False, None)
    with pytest.raises(SystemExit):
        training.TrainConfig.from_args(["--epochs", "0"])
    with pytest.raises(SystemExit):
        training.TrainConfig.from_args(["--data-source", "cifar"])


@pytest.mark.parametrize("wrap", [False, True])
def test_checkpoint_round_trip_strips_module_prefix(tmp_path, wrap):
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(2, 784)).sum().backward()
    opt.step()
    saved = nn.DataParallel(model) if wrap else model
    checkpoint.save_checkpoint(CTX, tmp_path / "c.pt", saved, opt, epoch=3)
    assert [p.name for p in tmp_path.iterdir()] == ["c.pt"]  # no temporary file left
    state = torch.load(tmp_path / "c.pt", weights_only=True)
    assert not any(k.startswith("module.") for k in state["model"])

    fresh = MLP()
    fresh_opt = torch.optim.SGD(fresh.parameters(), lr=0.1, momentum=0.9)
    target = nn.DataParallel(fresh) if not wrap else fresh
    extra = checkpoint.load_checkpoint(tmp_path / "c.pt", target, fresh_opt)
    assert extra == {"epoch": 3}
    for a, b in zip(model.state_dict().values(), fresh.state_dict().values()):
        torch.testing.assert_close(a, b)
    assert fresh_opt.state_dict()["state"][0]["momentum_buffer"] is not None


def test_load_plain_state_dict_with_prefix(tmp_path):
    model = MLP()
    torch.save({"module." + k: v for k, v in model.state_dict().items()}, tmp_path / "raw.pt")
    fresh = MLP()
    assert checkpoint.load_checkpoint(tmp_path / "raw.pt", fresh) == {}
    with pytest.raises(FileNotFoundError):
        checkpoint.load_checkpoint(tmp_path / "missing.pt", fresh)


def test_checkpoint_loads_into_the_course_data_parallel(tmp_path):
    from ddp_course.data_parallel import DataParallel

    model = MLP()
    checkpoint.save_checkpoint(CTX, tmp_path / "c.pt", model)
    wrapped = DataParallel(MLP(), num_replicas=2)
    checkpoint.load_checkpoint(tmp_path / "c.pt", wrapped)
    for a, b in zip(model.state_dict().values(), wrapped.module.state_dict().values()):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("damage", ["truncated", "garbage", "empty"])
def test_a_corrupt_checkpoint_error_names_the_file(tmp_path, damage):
    path = tmp_path / "c.pt"
    checkpoint.save_checkpoint(CTX, path, MLP())
    data = path.read_bytes()
    path.write_bytes(
        {"truncated": data[: len(data) // 2], "garbage": b"not a checkpoint" * 9, "empty": b""}[
            damage
        ]
    )
    with pytest.raises(RuntimeError, match="cannot load the checkpoint") as info:
        checkpoint.load_checkpoint(path, MLP())
    assert str(path) in str(info.value)


def test_a_save_that_fails_midway_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    path = tmp_path / "c.pt"
    torch.manual_seed(0)
    old = MLP()
    checkpoint.save_checkpoint(CTX, path, old, epoch=1)
    real_save = torch.save

    def crash_midway(obj, f, *args, **kwargs):
        # Write half a checkpoint to whatever file save_checkpoint chose, then die.
        real_save(obj, f, *args, **kwargs)
        with open(f, "r+b") as handle:
            handle.truncate(pathlib.Path(f).stat().st_size // 2)
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", crash_midway)
    with pytest.raises(OSError, match="disk full"):
        checkpoint.save_checkpoint(CTX, path, MLP(), epoch=2)
    monkeypatch.undo()
    fresh = MLP()
    assert checkpoint.load_checkpoint(path, fresh) == {"epoch": 1}  # the previous one, intact
    for a, b in zip(old.state_dict().values(), fresh.state_dict().values()):
        torch.testing.assert_close(a, b)
    assert [p.name for p in tmp_path.iterdir()] == ["c.pt"]  # no temporary file left


@pytest.mark.skipif(os.name != "posix", reason="folders are synced on POSIX systems only")
def test_save_syncs_the_data_before_the_rename_and_the_folder_after(tmp_path, monkeypatch):
    # os.replace alone survives a crash of the process, not of the host: the new
    # file's bytes and the rename may still be in the page cache. The order of
    # the calls is what makes a host crash leave the old or the whole new file.
    calls = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        info = os.fstat(fd)
        calls.append(("fsync", info.st_ino, stat.S_ISDIR(info.st_mode)))
        real_fsync(fd)

    def replace(src, dst):
        calls.append(("replace", str(dst)))
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    path = tmp_path / "c.pt"
    checkpoint.save_checkpoint(CTX, path, MLP(), epoch=1)
    # The renamed file keeps the temporary file's inode.
    assert calls == [
        ("fsync", path.stat().st_ino, False),
        ("replace", str(path)),
        ("fsync", tmp_path.stat().st_ino, True),
    ]


def test_rng_states_survive_a_weights_only_round_trip(tmp_path):
    import random

    states = checkpoint.rng_states()
    expected = (random.random(), torch.rand(3))
    torch.save(states, tmp_path / "rng.pt")
    checkpoint.restore_rng_states(torch.load(tmp_path / "rng.pt", weights_only=True))
    again = (random.random(), torch.rand(3))
    assert again[0] == expected[0]
    torch.testing.assert_close(again[1], expected[1], rtol=0, atol=0)


def _sgd_step(model, scale):
    """One SGD step on a fixed batch, with the gradient multiplied by ``scale``."""
    torch.manual_seed(1)
    x, y = torch.randn(8, 20), torch.randint(0, 5, (8,))
    model.zero_grad()
    (scale * torch.nn.functional.cross_entropy(model(x), y)).backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= 0.5 * p.grad


def _models(*scales):
    torch.manual_seed(0)
    initial = MLP(in_features=20, hidden=16, num_classes=5)
    models = []
    for scale in scales:
        m = MLP(in_features=20, hidden=16, num_classes=5)
        m.load_state_dict(initial.state_dict())
        _sgd_step(m, scale)
        models.append(m)
    return initial, models


def test_equal_steps_pass_and_report_the_gap():
    initial, (a, b) = _models(1.0, 1.0)
    result = check_same_training(a, b, initial, atol=1e-6)
    assert result["gap"] == 0 and result["moved"] == parameter_gap(a, initial) > 1e-4


def test_a_gradient_twice_too_large_fails():
    initial, (a, b) = _models(1.0, 2.0)  # what an all-reduce that sums over 2 ranks does
    with pytest.raises(AssertionError, match="did not take the same steps"):
        check_same_training(a, b, initial, atol=1e-6)


def test_a_tolerance_as_large_as_the_step_is_refused():
    initial, (a, b) = _models(1.0, 2.0)
    with pytest.raises(AssertionError, match="train longer"):
        check_same_training(a, b, initial, atol=1.0)


def test_models_of_different_shapes_are_refused():
    with pytest.raises(ValueError, match="same parameter shapes"):
        parameter_gap(MLP(in_features=20), MLP(in_features=10))
