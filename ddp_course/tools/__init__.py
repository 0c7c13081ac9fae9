"""Measuring and diagnosing distributed jobs: ``collective_log`` (every collective a
rank runs, whichever code path issued it: op, bytes, group), ``zero_counts`` (the bytes of
state a rank holds and of the collectives it ran, lesson 09), ``fsdp_units`` (FSDP2's
units: the order of their all-gathers and forwards, the bytes a model's parameters
occupy, lesson 09), ``mesh_counts`` (a layout's
training step counted per phase and mesh dimension, lesson 13), ``saved_tensors`` (the bytes
autograd saves for backward, each storage once, lessons 13 and 14), ``op_counts`` (the ATen
operations that run: what a checkpoint recomputes, lesson 14), ``peak_memory`` (a training
step's allocator peak and the gathered weights FSDP2 holds at once, lesson 14),
``graph_count`` (the graphs ``torch.compile`` builds and why it recompiled, lesson 16),
``kineto_log`` (the profiler's own start-up lines kept out of a lesson's output),
``bench`` (timing, busbw, alpha-beta fits, result files), ``scaling`` (speed-up,
efficiency, a step-time model), ``trace`` (profiler traces: how much communication
overlaps compute), ``flops`` (model FLOPs per token, peak
FLOP/s by exact device name, MFU), ``monitor`` (per-rank metrics and memory) and
``debug`` (stack dumps, the flight recorder, desync checks).
"""
