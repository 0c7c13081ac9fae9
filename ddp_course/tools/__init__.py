"""Measuring and diagnosing distributed jobs: ``collective_log`` (every collective a
rank runs, whichever code path issued it: op, bytes, group), ``bench`` (timing, busbw,
alpha-beta fits, result files), ``scaling`` (speed-up, efficiency, a step-time model), ``trace``
(profiler traces: how much communication overlaps compute), ``flops`` (model FLOPs
per token, peak FLOP/s by exact device name, MFU), ``monitor`` (per-rank metrics and
memory) and ``debug`` (stack dumps, the flight recorder, desync checks).
"""
