"""Training and evaluation loops shared by the single-process and the
distributed scripts, and their typed configuration.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional
from torch.utils.data import DataLoader, Dataset, Subset
from tqdm.auto import tqdm

from .runtime import DistContext

__all__ = [
    "EpochStats",
    "TrainConfig",
    "check_same_training",
    "evaluate",
    "parameter_gap",
    "sgd_step_fn",
    "shard_indices",
    "train_one_epoch",
]


@dataclasses.dataclass
class TrainConfig:
    """Settings of the training scripts; each field is a command-line flag.

    ``batch_size`` is per rank: N ranks with batch b see N*b samples per
    step, the same as one process with batch N*b.
    """

    epochs: int = dataclasses.field(default=5, metadata={"help": "passes over the data"})
    batch_size: int = dataclasses.field(default=32, metadata={"help": "samples per step per rank"})
    lr: float = dataclasses.field(default=1e-3, metadata={"help": "learning rate"})
    seed: int = dataclasses.field(default=0, metadata={"help": "seed, the same on every rank"})
    data_dir: str = dataclasses.field(default="data", metadata={"help": "folder for full MNIST"})
    data_source: str = dataclasses.field(
        default="subset",
        metadata={
            "help": "subset (the bundled 5,000 digits), full or auto (full when online)",
            "choices": ["auto", "full", "subset"],
        },
    )
    checkpoint: str | None = dataclasses.field(
        default=None, metadata={"help": "save the model here after each epoch, resume from it"}
    )
    results: str | None = dataclasses.field(
        default=None, metadata={"help": "write a JSON summary of the run here"}
    )
    max_steps: int | None = dataclasses.field(
        default=None, metadata={"help": "stop each epoch after this many steps (for tests)"}
    )
    dropout: bool = dataclasses.field(
        default=True, metadata={"help": "dropout layers (off: deterministic runs to compare)"}
    )
    progress: bool = dataclasses.field(default=True, metadata={"help": "progress bar on rank 0"})

    @classmethod
    def parser(cls, description: str | None = None) -> argparse.ArgumentParser:
        """An ``argparse`` parser with one ``--flag`` per field."""
        parser = argparse.ArgumentParser(description=description)
        for field in dataclasses.fields(cls):
            flag = "--" + field.name.replace("_", "-")
            help_text = f"{field.metadata['help']} (default: {field.default})"
            if field.type == "bool":
                parser.add_argument(
                    flag,
                    action=argparse.BooleanOptionalAction,
                    default=field.default,
                    help=help_text,
                )
                continue
            kind = {"int": int, "float": float}.get(field.type.split(" |")[0], str)
            parser.add_argument(
                flag,
                type=kind,
                default=field.default,
                help=help_text,
                choices=field.metadata.get("choices"),
            )
        return parser

    @classmethod
    def from_args(cls, argv=None, description: str | None = None) -> TrainConfig:
        """Parse ``argv`` (default ``sys.argv[1:]``) into a config.

        Raises:
            SystemExit: on an unknown flag or a non-positive epoch count,
                batch size or learning rate, with argparse's usage message.
        """
        parser = cls.parser(description)
        return cls.from_namespace(vars(parser.parse_args(argv)), parser)

    @classmethod
    def from_namespace(cls, values: dict, parser: argparse.ArgumentParser) -> TrainConfig:
        """A config from parsed ``values``; keys that are not fields are ignored.

        For scripts that add options of their own to :meth:`parser`.

        Raises:
            SystemExit: through ``parser.error`` on a non-positive epoch
                count, batch size or learning rate.
        """
        names = {field.name for field in dataclasses.fields(cls)}
        config = cls(**{k: v for k, v in values.items() if k in names})
        for name in ("epochs", "batch_size", "lr"):
            if getattr(config, name) <= 0:
                parser.error(f"--{name.replace('_', '-')} must be positive")
        return config


@dataclasses.dataclass(frozen=True)
class EpochStats:
    """What one training epoch did, summed over all ranks.

    Attributes:
        loss: mean training loss per sample.
        samples: samples processed by all ranks together.
        seconds: wall-clock time of the epoch on this rank, in seconds.
    """

    loss: float
    samples: int
    seconds: float

    @property
    def samples_per_s(self) -> float:
        """Throughput of the whole job, in samples per second."""
        return self.samples / self.seconds


def _sum_over_ranks(ctx: DistContext, *values: float) -> list[float]:
    # float64 so that sums of counts stay exact integers.
    t = torch.tensor(values, dtype=torch.float64, device=ctx.device)
    if ctx.is_distributed:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t.tolist()


def _inputs_for(model: nn.Module, x: torch.Tensor, ctx: DistContext) -> torch.Tensor:
    # A batch on the rank's device, and floating inputs in the model's dtype
    # (MNIST is float32; a float64 model, as in lesson 05's check, needs float64).
    param = next(model.parameters(), None)
    dtype = param.dtype if param is not None and x.is_floating_point() else None
    return x.to(ctx.device, dtype=dtype, non_blocking=True)


def train_one_epoch(
    model: nn.Module,
    loader: DataLoader,
    optimizer: torch.optim.Optimizer,
    ctx: DistContext,
    epoch: int = 0,
    max_steps: int | None = None,
    progress: bool = True,
) -> EpochStats:
    """One pass over ``loader``: forward, cross-entropy loss, backward, step.

    Works unchanged for a plain model and for a DDP model (whose backward
    all-reduces the gradients). The returned loss and sample count are
    summed over all ranks, so every rank returns the same numbers.

    Args:
        model: returns logits ``[B, C]`` for a batch ``x``; floating batches
            are cast to the dtype of its parameters (float32 or float64).
        loader: yields ``(x, y)`` with ``y`` int64 ``[B]``.
        max_steps: stop after this many steps (tests and smoke runs).
        progress: draw a tqdm bar (on rank 0 only).
    """
    model.train()
    loss_fn = nn.CrossEntropyLoss()
    total_loss, total = 0.0, 0
    start = time.perf_counter()
    steps = len(loader) if max_steps is None else min(max_steps, len(loader))
    bar = tqdm(
        total=steps,
        desc=f"epoch {epoch}",
        disable=not (progress and ctx.is_main),
        leave=False,
        unit="step",
    )
    for step, (x, y) in enumerate(loader):
        if step == steps:
            break
        x, y = _inputs_for(model, x, ctx), y.to(ctx.device, non_blocking=True)
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(model(x), y)
        loss.backward()
        optimizer.step()
        total_loss += loss.item() * len(y)
        total += len(y)
        bar.update()
        bar.set_postfix(loss=f"{loss.item():.3f}")
    bar.close()
    loss_sum, count = _sum_over_ranks(ctx, total_loss, total)
    return EpochStats(loss_sum / max(count, 1), int(count), time.perf_counter() - start)


def shard_indices(num_samples: int, rank: int, world_size: int) -> range:
    """The indices rank ``rank`` evaluates: ``rank, rank + N, rank + 2N, ...``.

    Unlike ``DistributedSampler`` this never pads, so every index is on
    exactly one rank and sums over ranks count each sample once.
    """
    return range(rank, num_samples, world_size)


@torch.no_grad()
def evaluate(
    model: nn.Module,
    dataset: Dataset,
    ctx: DistContext,
    batch_size: int = 256,
) -> dict[str, float]:
    """Exact accuracy and loss over ``dataset``, split across ranks.

    Each rank evaluates its :func:`shard_indices` and the correct counts,
    loss sums and sample counts are all-reduced, so the result equals a
    single process evaluating the whole set, for any world size. (A padded
    ``DistributedSampler`` would count repeated samples twice.) Floating
    inputs are cast to the dtype of the model's parameters.

    Returns:
        ``{"accuracy": float in [0, 1], "loss": mean cross-entropy,
        "samples": int, the size of dataset}``, the same on every rank.
    """
    model.eval()
    shard = Subset(dataset, list(shard_indices(len(dataset), ctx.rank, ctx.world_size)))
    loss_fn = nn.CrossEntropyLoss(reduction="sum")
    correct = loss_sum = count = 0.0
    for x, y in DataLoader(shard, batch_size=batch_size):
        x, y = _inputs_for(model, x, ctx), y.to(ctx.device)
        logits = model(x)
        loss_sum += loss_fn(logits, y).item()
        correct += (logits.argmax(1) == y).sum().item()
        count += len(y)
    correct, loss_sum, count = _sum_over_ranks(ctx, correct, loss_sum, count)
    return {"accuracy": correct / count, "loss": loss_sum / count, "samples": int(count)}


def parameter_gap(a: nn.Module, b: nn.Module) -> float:
    """Largest absolute difference between matching parameters of ``a`` and ``b``.

    Parameters are paired in ``parameters()`` order and compared in float64.

    Raises:
        ValueError: if the models do not have the same parameter shapes.
    """
    pa, pb = list(a.parameters()), list(b.parameters())
    if [p.shape for p in pa] != [p.shape for p in pb]:
        raise ValueError("the two models do not have the same parameter shapes")
    return max(
        (p.detach().double() - q.detach().double()).abs().max().item() for p, q in zip(pa, pb)
    )


def check_same_training(
    reference: nn.Module, other: nn.Module, initial: nn.Module, atol: float
) -> dict[str, float]:
    """Assert that ``other`` trained exactly like ``reference``, to ``atol``.

    The check of lesson 05's claim "N ranks x batch b = one process x batch
    N*b": every parameter of ``other`` equals the one of ``reference`` within
    ``atol`` (float rounding: the all-reduce sums in another order than one
    process does), while training moved ``reference`` away from ``initial``
    by more than ``100 * atol``, so the tolerance cannot hide a real step.
    Use plain SGD: its step is proportional to the gradient, so a gradient
    off by a factor N moves the parameters N times as far; Adam's step
    hardly changes when every gradient is scaled (Kingma and Ba 2015,
    section 2.1) and would hide it.

    Returns:
        ``{"gap": largest |other - reference|, "moved": largest
        |reference - initial|}``, both in parameter units.

    Raises:
        AssertionError: if the gap exceeds ``atol`` or training did not move
            the parameters by more than ``100 * atol``.
    """
    gap, moved = parameter_gap(reference, other), parameter_gap(reference, initial)
    if moved <= 100 * atol:
        raise AssertionError(
            f"training moved the parameters by at most {moved:.2e}, not more than 100 x the "
            f"tolerance {atol:.0e}: train longer or with a larger learning rate"
        )
    if gap > atol:
        raise AssertionError(
            f"the models differ by up to {gap:.2e} ({gap / atol:,.0f} x the tolerance "
            f"{atol:.0e}): they did not take the same steps"
        )
    return {"gap": gap, "moved": moved}


def sgd_step_fn(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    accum: int = 1,
    no_sync: bool = False,
    lr: float = 0.01,
) -> Callable[[], None]:
    """One SGD step over ``accum`` micro-batches, as a function of no arguments to time.

    Every call runs ``accum`` forward and backward passes of the same batch
    (cross-entropy, each loss divided by ``accum``, so the gradients add up to
    the mean) and one ``optimizer.step()``. With ``no_sync``, the first
    ``accum - 1`` backward passes run inside ``model.no_sync()`` (DDP's
    gradient accumulation without an all-reduce), the last one synchronises.

    Args:
        model: a module, or a DDP wrapper when ``no_sync``.
        x: inputs, ``[batch, ...]`` on the model's device.
        y: class labels, ``int64 [batch]``.
        accum: micro-batches per step, >= 1.
        no_sync: skip the all-reduce of all but the last micro-batch.
        lr: SGD's learning rate.

    Raises:
        ValueError: ``accum < 1``, or ``no_sync`` for a model without ``no_sync()``.
    """
    if accum < 1:
        raise ValueError(f"accum must be >= 1, not {accum}")
    if no_sync and not hasattr(model, "no_sync"):
        raise ValueError("no_sync needs a DDP wrapper (a model with a no_sync() method)")
    opt = torch.optim.SGD(model.parameters(), lr=lr)

    def step() -> None:
        opt.zero_grad()
        for i in range(accum):
            skip = no_sync and i < accum - 1
            with model.no_sync() if skip else contextlib.nullcontext():
                (functional.cross_entropy(model(x), y) / accum).backward()
        opt.step()

    return step
