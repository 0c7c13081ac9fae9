"""ddp_course: the helper package behind the ddp-course notebooks.

Modules, one concern each: ``runtime`` (ranks, devices, process groups,
logging), ``launch`` (torchrun from notebooks and tests), ``data`` (MNIST and
synthetic data), ``models``, ``engine`` (train and exact evaluation),
``checkpoint``, ``collectives`` (ring and parameter-server all-reduce from
point-to-point), ``comm_cost`` (the bytes each rank moves in those algorithms),
``async_sgd`` (synchronous against asynchronous parameter-server SGD,
simulated), ``bench`` (timing, the slowest rank, algbw/busbw of every
collective, alpha-beta fits, JSON/CSV records), ``scaling`` (strong/weak
efficiency, Amdahl and Gustafson fits, a DDP step-time model), ``trace``
(profiler Chrome traces: overlap of communication with backward), ``parallel``
(a from-scratch DataParallel), ``ddp`` (DistributedDataParallel from scratch:
per-parameter and bucketed, overlapped with backward), ``pipeline`` (schedules
as data, deadlock check, simulated and executed pipeline timelines),
``tensor_parallel`` (Megatron-LM's column- and row-parallel MLP with the f and g
operators), ``sharding`` (ZeRO stages 1-3 from scratch and the paper's memory
per rank), ``sampler`` (a from-scratch distributed sampler), ``multinode`` and
``netns`` (several torchrun agents as the nodes of one job, also across network
namespaces), ``slurm`` (a one-node Slurm for testing batch scripts), ``monitor``
(per-rank metrics gathered on rank 0, JSON/TensorBoard, stragglers), ``debug``
(repeated epoch orders, cross-rank model digests, py-spy stack dumps,
flight-recorder dumps).
"""

__version__ = "0.1.0"
