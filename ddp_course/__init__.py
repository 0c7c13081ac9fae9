"""ddp_course: the package behind the ddp-course notebooks.

Its top level is what the lessons teach, one mechanism per module: ``runtime`` (ranks,
devices, the process group), ``data_parallel`` (DataParallel from scratch) with
``replica_plan`` (which DataParallel, on which devices), ``collectives`` (ring and
parameter-server collectives from point-to-point; PyTorch's fused all-gather and
reduce-scatter, which the sharding mechanisms call, are in ``builtin_collectives``),
``comm_cost`` (the bytes each rank moves in them), ``partition`` (which elements each
rank owns), ``parameter_server`` (synchronous against asynchronous parameter-server SGD,
simulated), ``sampler`` (a distributed sampler from scratch), ``ddp``
(DistributedDataParallel from scratch: per-parameter and bucketed, overlapped with
backward), ``pipeline`` (schedules, their simulation and their execution),
``tensor_parallel`` (Megatron-LM's column- and row-parallel MLP and attention),
``sequence_parallel`` (sequence parallelism and tensor-parallel Transformer blocks),
``parallel_gpt`` (TinyGPT split over tensor-parallel ranks and gathered back whole) with
``parallel_gpt_runs`` (its training against one process, the labs), ``parallel_rng``
(dropout random numbers per region and rank), ``mesh_layouts`` (TinyGPT's layouts on a
device mesh with PyTorch's own parallelisms), ``mesh_model`` (a layout's training step),
``mesh_runs`` (training a layout against one process, the checkpoint round trip) and
``mesh_predictions`` (what each layout holds and runs, and what a tensor-parallel block
saves), ``sharding`` (ZeRO stages 1-3 and their memory and traffic), ``fsdp`` (FSDP as a
module wrapper whose parameters are this rank's shards, as FSDP2 does),
``activation_memory``, ``activation_checkpoint``, ``recompute_policies`` and
``step_budget`` (what a step saves for backward, recomputing it, and a step's budget),
``context_parallel`` (placement and masks, blockwise attention, the ring schedule, ring
attention, Ulysses, and their work and bytes per rank), ``expert_parallel`` (a mixture
of experts over ranks; ``expert_parallel_dropless``, GShard's padded exchange to compare
with, and ``expert_data_parallel``, EP x DP groups), ``local_sgd`` (local SGD and
DiLoCo: synchronise every H steps), ``checkpoint``, ``training`` (train
and exact evaluation loops), ``data`` and ``models``.

Two subpackages hold the rest: ``tools`` measures and diagnoses a job
(``collective_log``, ``bench``, ``scaling``, ``trace``, ``monitor``, ``debug``,
``flops``, ``saved_tensors``, ``op_counts``, ``peak_memory``, ``kineto_log``,
``mesh_counts``, ``mesh_suite``, ``parallel_gpt_counts``, ``zero_counts``, ``fsdp_units``,
``graph_count``);
``harness`` runs the course (``launch`` and its parts, ``restarts``, ``multinode``,
``netns``, ``slurm`` and their parts, the command line ``cli``, ``gpu_check`` and its
parts, the scripts' shared flags ``script_args``, and the notebooks' ``notebook``
helpers).
"""

__version__ = "0.1.0"
