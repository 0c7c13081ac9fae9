"""Measuring communication: timing, algbw/busbw and the alpha-beta model.

One idea per module, everything importable from here: :mod:`.bandwidth` (algbw and
busbw as nccl-tests' PERFORMANCE.md defines them, the sizes of a sweep), :mod:`.timing`
(every rank at once, the slowest rank per iteration, median and interquartile range)
and :mod:`.cost_models` (alpha-beta fits and what they predict); :mod:`.links` (one
device plan for a sweep over world sizes, and the name of the link it measured). Result files:
:mod:`ddp_course.tools.records`.
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
from .links import link_label, sweep_device_plan
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
    "link_label",
    "format_bytes",
    "message_sizes",
    "parameter_server_time",
    "predicted_busbw",
    "ring_all_reduce_time",
    "runnable_tasks",
    "scaling_efficiency",
    "slowest_rank",
    "summarize",
    "sweep_device_plan",
    "time_interleaved",
    "time_op",
]
