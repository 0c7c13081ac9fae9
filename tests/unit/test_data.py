"""data: the bundled MNIST subset, the offline error, synthetic data."""

import gzip

import numpy as np
import pytest
import torch
from torchvision import datasets

from ddp_course import data


def test_bundled_subset_loads_with_torchvision_itself():
    train = datasets.MNIST(data.BUNDLED_ROOT, train=True)
    test = datasets.MNIST(data.BUNDLED_ROOT, train=False)
    assert (len(train), len(test)) == (4000, 1000)
    for split in (train, test):
        assert split.data.shape[1:] == (28, 28) and split.data.dtype == torch.uint8
        assert sorted(split.targets.unique().tolist()) == list(range(10))
    # Real digits, not noise: ink covers roughly a fifth of an MNIST image.
    ink = (train.data > 0).float().mean().item()
    assert 0.1 < ink < 0.3


def test_load_mnist_falls_back_to_the_subset_and_says_so(tmp_path):
    split = data.load_mnist(tmp_path, train=False, download=False)
    assert split.source == "subset"
    image, label = split.dataset[0]
    assert image.shape == (1, 28, 28) and image.dtype == torch.float32
    assert isinstance(label, int)


def test_full_mnist_without_data_or_network_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="source='subset'"):
        data.load_mnist(tmp_path, source="full", download=False)
    with pytest.raises(ValueError, match="source must be"):
        data.load_mnist(tmp_path, source="imagenet")


def test_full_mnist_is_used_when_present(tmp_path):
    raw = tmp_path / "MNIST" / "raw"
    raw.mkdir(parents=True)
    # Full-size headers are what marks full MNIST; fill with zeros.
    for split, n in (("train", 60_000), ("test", 10_000)):
        images, labels = data._FILES[split]
        data.write_idx(raw / images, np.zeros((n, 28, 28), np.uint8))
        data.write_idx(raw / labels, np.zeros(n, np.uint8))
    assert data.has_full_mnist(tmp_path) and not data.has_full_mnist(data.BUNDLED_ROOT)
    split = data.load_mnist(tmp_path, train=False, source="auto", download=False)
    assert split.source == "full" and len(split.dataset) == 10_000
    assert data.load_mnist(tmp_path, train=False, source="full").source == "full"
    # The default stays the bundled subset, so every learner sees the stored numbers.
    split = data.load_mnist(tmp_path, train=False)
    assert split.source == "subset" and len(split.dataset) == 1000


def test_the_network_is_probed_once_per_process_with_a_short_timeout(tmp_path, monkeypatch):
    calls = []

    def offline(address, timeout=None):
        calls.append((address, timeout))
        raise OSError("network unreachable")

    monkeypatch.setattr(data.socket, "create_connection", offline)
    data.online.cache_clear()
    try:
        for train in (True, False, True):
            split = data.load_mnist(tmp_path, train=train, source="auto", download=True)
            assert split.source == "subset"
        with pytest.raises(FileNotFoundError, match="could not be downloaded"):
            data.load_mnist(tmp_path, source="full", download=True)
    finally:
        data.online.cache_clear()  # the next test probes for itself
    assert len(calls) == 1
    assert calls[0][1] is not None and calls[0][1] <= 3


def test_build_subset_round_trips_through_torchvision(tmp_path):
    rng = np.random.default_rng(1)
    labels = np.arange(200) % 10
    pixels = rng.integers(0, 256, (200, 784))
    csv = tmp_path / "tiny.csv.gz"
    with gzip.open(csv, "wt") as f:
        np.savetxt(f, np.column_stack([pixels, labels]), fmt="%d", delimiter=",")
    sizes = data.build_subset(csv, tmp_path / "out", num_test=50, seed=0)
    assert sizes == {"train": 150, "test": 50}
    train = datasets.MNIST(tmp_path / "out", train=True)
    test = datasets.MNIST(tmp_path / "out", train=False)
    together = torch.cat([train.data.flatten(1), test.data.flatten(1)])
    assert sorted(map(tuple, together.tolist())) == sorted(map(tuple, pixels.tolist()))


def test_synthetic_classification_is_seeded_and_shaped():
    a = data.synthetic_classification(64, (3, 8, 8), num_classes=5, seed=3)
    b = data.synthetic_classification(64, (3, 8, 8), num_classes=5, seed=3)
    x, y = a.tensors
    assert x.shape == (64, 3, 8, 8) and x.dtype == torch.float32
    assert y.dtype == torch.int64 and int(y.max()) < 5
    torch.testing.assert_close(x, b.tensors[0])
    with pytest.raises(ValueError):
        data.synthetic_classification(0)


def test_split_tensors_are_the_data_set_in_memory():
    split = data.load_mnist(train=False, source="subset")
    images, labels = split.tensors()
    assert images.shape == (1000, 1, 28, 28) and images.dtype == torch.float32
    assert labels.shape == (1000,) and labels.dtype == torch.int64
    for i in (0, 999):
        x, y = split.dataset[i]
        assert torch.equal(images[i], x) and labels[i].item() == y


def test_shakespeare_bytes_are_the_three_plays_split_train_val():
    every = data.shakespeare_bytes("all")
    assert every.dtype == torch.int64 and len(every) == 298_115
    assert int(every.min()) >= 10 and int(every.max()) < 128  # ASCII text
    train, val = data.shakespeare_bytes("train"), data.shakespeare_bytes("val")
    torch.testing.assert_close(torch.cat([train, val]), every)
    assert len(val) == len(every) - int(len(every) * 0.9)
    assert bytes(every[:7].tolist()) == b"MACBETH"
    with pytest.raises(ValueError, match="split"):
        data.shakespeare_bytes("test")


def test_lm_batch_targets_are_the_next_tokens():
    tokens = torch.arange(100)
    x, y = data.lm_batch(tokens, 4, 10, torch.Generator().manual_seed(0))
    assert x.shape == y.shape == (4, 10)
    torch.testing.assert_close(y, x + 1)
    again = data.lm_batch(tokens, 4, 10, torch.Generator().manual_seed(0))
    torch.testing.assert_close(again[0], x)
    with pytest.raises(ValueError, match="longer than seq_len"):
        data.lm_batch(torch.arange(5), 1, 5, torch.Generator())
