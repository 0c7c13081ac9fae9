"""Synchronous and asynchronous parameter-server SGD, simulated in one process.

Notebook 04 uses it to show what stale gradients do to training: an
asynchronous parameter server applies each worker's gradient as soon as it
arrives, computed on parameters several updates old, and needs a smaller
learning rate than synchronous all-reduce training (Zhang et al.,
"Staleness-aware Async-SGD for distributed deep learning", IJCAI 2016).
"""

from __future__ import annotations

import math

import torch

__all__ = ["simulate_parameter_server"]


def simulate_parameter_server(
    mode: str = "sync",
    num_workers: int = 4,
    staleness: int | None = None,
    lr: float = 0.1,
    rounds: int = 100,
    features: int = 10,
    samples_per_worker: int = 64,
    seed: int = 0,
) -> list[float]:
    """Least-squares regression trained by a simulated parameter server.

    One process, deterministic (float64, fixed seed). Each of the N workers
    owns a shard of a linear-regression data set ``y = X w* + noise`` and
    computes mean-squared-error gradients on it.

    - ``mode="sync"``: each round averages the N workers' gradients, all
      computed on the current parameters, and makes one update (what an
      all-reduce or a synchronous parameter server gives: the same as one
      process with the whole batch).
    - ``mode="async"``: the server applies each worker's gradient as it
      arrives, one update per gradient (workers take turns), and that
      gradient was computed on the parameters as they were ``staleness``
      updates earlier: the worker read them, computed, and meanwhile others
      pushed theirs. With N equally fast workers the staleness is N - 1
      (the default); ``staleness=0`` is sequential SGD over the shards.

    On a quadratic with curvature c, gradient descent delayed by k updates
    (``x <- x - lr * c * x_{t-k}``) is stable only for
    ``lr * c < 2 sin(pi / (4k + 2))``: 2 without delay, 0.45 for k = 3. That
    is why asynchronous training needs smaller learning rates (Zhang et al.,
    "Staleness-aware Async-SGD for distributed deep learning", IJCAI 2016).

    Args:
        mode: ``"sync"`` or ``"async"``.
        num_workers: N >= 1.
        staleness: delay k >= 0 in updates (async only; default N - 1).
        lr: learning rate per update, > 0.
        rounds: rounds of N gradients each, >= 1.
        features, samples_per_worker: data set shape, >= 1.
        seed: seeds the data set; the parameters start at zero.

    Returns:
        Mean squared error on the whole data set before training and after
        each round (length ``rounds + 1``); ``inf`` from the round where
        training diverged on.

    Raises:
        ValueError: unknown mode, a non-positive size or learning rate,
            negative staleness, or staleness given with ``mode="sync"``.
    """
    if mode not in ("sync", "async"):
        raise ValueError(f"mode must be 'sync' or 'async', not {mode!r}")
    if min(num_workers, rounds, features, samples_per_worker) < 1:
        raise ValueError("num_workers, rounds, features and samples_per_worker must be >= 1")
    if mode == "sync" and staleness not in (None, 0):
        raise ValueError("synchronous updates have no staleness")
    k = num_workers - 1 if staleness is None else staleness
    if k < 0:
        raise ValueError(f"staleness must be >= 0, not {k}")
    if not lr > 0:
        raise ValueError(f"lr must be positive, not {lr}")
    gen = torch.Generator().manual_seed(seed)
    n = num_workers * samples_per_worker
    x = torch.randn(n, features, generator=gen, dtype=torch.float64)
    w_true = torch.randn(features, generator=gen, dtype=torch.float64)
    y = x @ w_true + 0.1 * torch.randn(n, generator=gen, dtype=torch.float64)
    shards = list(zip(x.split(samples_per_worker), y.split(samples_per_worker), strict=True))

    def loss(w: torch.Tensor) -> float:
        return float(((x @ w - y) ** 2).mean())

    def grad(w: torch.Tensor, worker: int) -> torch.Tensor:
        xs, ys = shards[worker]
        return 2.0 / len(ys) * xs.T @ (xs @ w - ys)

    w = torch.zeros(features, dtype=torch.float64)
    losses = [loss(w)]
    versions = [w]  # the last k + 1 parameter versions, oldest first
    for _ in range(rounds):
        if mode == "sync":
            w = w - lr * sum(grad(w, i) for i in range(num_workers)) / num_workers
        else:
            for i in range(num_workers):
                w = w - lr * grad(versions[0], i)
                versions = (versions + [w])[-(k + 1) :]
        value = loss(w)
        if not math.isfinite(value) or value > 1e6 * losses[0]:
            losses += [math.inf] * (rounds + 1 - len(losses))
            break
        losses.append(value)
    return losses
