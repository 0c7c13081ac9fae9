"""Measuring communication: timing, algbw/busbw, the alpha-beta model, result files.

Definitions follow nccl-tests' PERFORMANCE.md
(https://github.com/NVIDIA/nccl-tests/blob/master/doc/PERFORMANCE.md):

- algorithm bandwidth ``algbw = S / t``: the message size S in bytes over
  the time t of one operation;
- bus bandwidth ``busbw = algbw * factor``, the factor making the number
  comparable to the link's peak whatever the world size n: ``2(n-1)/n``
  for all_reduce, ``(n-1)/n`` for reduce_scatter, all_gather and
  all_to_all, ``1`` for broadcast, reduce and send/recv;
- 1 GB/s = 1e9 bytes per second.

Timing differs from nccl-tests on one point, for a noisy shared CPU: each
timed iteration starts at a barrier, its time is the slowest rank's
(``all_reduce(MAX)`` over ranks) and the reported time is the median over
iterations after warm-up, with the interquartile range as the spread
(nccl-tests reports the mean over iterations).

One idea per module: :mod:`.bandwidth` (algbw, busbw, sweep sizes), :mod:`.timing`
(timing every rank at once) and :mod:`.cost_models` (alpha-beta fits and what they
predict); everything is importable from here. Result files: :mod:`ddp_course.tools.records`.
"""

from .bandwidth import (
    BUSBW_FACTORS,
    COLLECTIVES,
    GB,
    algbw,
    busbw,
    busbw_factor,
    format_bytes,
    message_sizes,
)
from .cost_models import (
    AlphaBeta,
    busbw_plateau,
    fit_alpha_beta,
    fit_each,
    parameter_server_time,
    predicted_busbw,
    ring_all_reduce_time,
    scaling_efficiency,
)
from .timing import (
    Timing,
    runnable_tasks,
    slowest_rank,
    summarize,
    time_interleaved,
    time_op,
)

__all__ = [
    "GB",
    "BUSBW_FACTORS",
    "COLLECTIVES",
    "AlphaBeta",
    "Timing",
    "algbw",
    "busbw",
    "busbw_factor",
    "busbw_plateau",
    "fit_alpha_beta",
    "fit_each",
    "format_bytes",
    "message_sizes",
    "parameter_server_time",
    "predicted_busbw",
    "ring_all_reduce_time",
    "runnable_tasks",
    "scaling_efficiency",
    "slowest_rank",
    "summarize",
    "time_interleaved",
    "time_op",
]
