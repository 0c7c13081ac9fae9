"""TinyGPT trained on a layout: pipeline stages, the loss over a global batch, one step
(notebook 13).

:class:`MeshModel` builds a :class:`~ddp_course.mesh_layouts.Layout` on its device mesh in
TorchTitan's order (a pipeline stage, tensor parallelism, data parallelism: see
:mod:`ddp_course.mesh_layouts`) and takes one training step on this rank's slice of the
global batch; :class:`GPTStage` and :func:`split_stages` cut TinyGPT into pipeline stages;
:func:`token_mean_loss` averages the loss over the real tokens of the whole global batch.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional

from .mesh_layouts import Layout, apply_data_parallel, apply_tensor_parallel
from .models import TinyGPT

__all__ = ["GPTStage", "MeshModel", "split_stages", "token_mean_loss"]


class GPTStage(nn.Module):
    """One pipeline stage of a :class:`TinyGPT`: a contiguous run of its blocks.

    The first stage also holds the embeddings (input ``int64 [B, T]``), the last
    the final LayerNorm and the head (output logits ``[B, T, V]``); the others map
    ``[B, T, d]`` to ``[B, T, d]``. Blocks keep their index as name
    (``blocks.3.attn.q.weight``), so parameter names equal the whole model's.

    Args:
        model: the whole TinyGPT; its modules are shared, not copied.
        first, last: block indices ``first <= i < last`` this stage keeps.
    """

    def __init__(self, model: TinyGPT, first: int, last: int):
        super().__init__()
        n_layers = len(model.blocks)
        self.seq_len = model.seq_len
        is_first, is_last = first == 0, last == n_layers
        self.tok_emb = model.tok_emb if is_first else None
        self.pos_emb = model.pos_emb if is_first else None
        self.drop = model.drop if is_first else None  # the embeddings' dropout, as in TinyGPT
        self.blocks = nn.ModuleDict({str(i): model.blocks[i] for i in range(first, last)})
        self.ln_f = model.ln_f if is_last else None
        self.head = model.head if is_last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tok_emb is not None:
            positions = torch.arange(x.shape[1], device=x.device)
            x = self.drop(self.tok_emb(x) + self.pos_emb(positions))
        for block in self.blocks.values():
            x = block(x)
        if self.head is not None:
            x = self.head(self.ln_f(x))
        return x


def split_stages(model: TinyGPT, stages: int) -> list[GPTStage]:
    """Cut ``model`` into ``stages`` :class:`GPTStage` s of equal numbers of blocks.

    Raises:
        ValueError: ``stages`` does not divide the number of blocks.
    """
    n_layers = len(model.blocks)
    if stages < 1 or n_layers % stages:
        raise ValueError(f"pp={stages} must divide the {n_layers} blocks of the model")
    per = n_layers // stages
    return [GPTStage(model, s * per, (s + 1) * per) for s in range(stages)]


def token_mean_loss(
    logits: torch.Tensor, targets: torch.Tensor, group, ignore_index: int = -100
) -> torch.Tensor:
    """Cross-entropy per *global* token, for sequences padded with ``ignore_index``.

    Each data-parallel rank sums its token losses and divides by the number of
    real tokens of the whole global batch (all-reduced over ``group``), then
    multiplies by the group's size, because DDP and FSDP *average* gradients
    over the ranks: the averaged gradient is then that of (sum of every token
    loss) / (global token count), the one-process loss, whatever the layout.
    Averaging per-rank means instead weights a token by 1 / (its rank's token
    count), which depends on how the batch is split.

    Args:
        logits: ``[B, T, V]``, this rank's slice of the batch.
        targets: ``int64 [B, T]``; padded positions hold ``ignore_index``.
        group: the data-parallel process group (the ranks that split the batch),
            required: the default group is the world, which under tensor or pipeline
            parallelism holds other ranks too (a pipeline's other stages never call
            this: a hang). ``None`` only in one process, with no process group.

    Returns:
        A scalar in the logits' dtype.

    Raises:
        ValueError: the global batch has no real token, or ``group`` is ``None`` while a
            process group is initialised.
    """
    if group is None and dist.is_initialized():
        raise ValueError(
            "token_mean_loss needs the data-parallel group: the default group "
            "is the world, not the ranks that split the batch"
        )
    total = functional.cross_entropy(
        logits.flatten(0, 1), targets.flatten(), ignore_index=ignore_index, reduction="sum"
    )
    count = (targets != ignore_index).sum().to(torch.float64)
    size = 1
    if group is not None:
        dist.all_reduce(count, group=group)
        size = dist.get_world_size(group)
    if count.item() == 0:
        raise ValueError("the global batch has no token other than ignore_index")
    return total * size / count.to(total.dtype)


class MeshModel:
    """TinyGPT laid out on a mesh: the parallelised module and one training step.

    Builds the layout in TorchTitan's order: pipeline stage, tensor parallelism,
    data parallelism. :meth:`forward_backward` takes this rank's slice of the
    global batch, leaves the gradients in the parameters and returns the loss
    averaged over the whole global batch.

    Args:
        model: a whole TinyGPT, the same weights on every rank (changed in place).
        lay: the layout.
        mesh: :func:`build_mesh` of ``lay``.
        microbatches: micro-batches per step of the pipeline schedule (GPipe).
        loss_parallel: with tensor parallelism, compute the loss on vocabulary shards.
            Ignored inside a pipeline (``lay.pp > 1``): ``loss_parallel()``'s backward
            must run under the same context manager (PyTorch's contract), but the
            schedule runs the loss and its backward apart, from inside ``step``; there the
            head's logits are all-gathered whole over ``tp`` and the loss is the plain one.
        reshard_after_forward: FSDP2's choice (False keeps the gathered parameters
            for backward: fewer all-gathers, more memory).
        compute_dtype: mixed precision (``torch.bfloat16``): the parameters stay in
            ``model``'s dtype; FSDP2 and HSDP compute in ``compute_dtype`` through their
            ``MixedPrecisionPolicy`` (:func:`apply_data_parallel`), DDP under
            ``torch.autocast`` (forward and loss; backward follows the forward's dtypes).
            The loss is computed on float32 logits. ``None``: compute in ``model``'s dtype.

    Raises:
        ValueError: ``compute_dtype`` with DDP inside a pipeline (its schedule runs
            forward and backward together, so autocast cannot cover the forward alone).
    """

    def __init__(
        self,
        model: TinyGPT,
        lay: Layout,
        mesh,
        microbatches: int = 2,
        loss_parallel: bool = True,
        reshard_after_forward: bool = True,
        compute_dtype: torch.dtype | None = None,
    ):
        if compute_dtype is not None and lay.data == "ddp" and lay.pp > 1:
            raise ValueError("mixed precision with DDP inside a pipeline: use fsdp")
        self.layout, self.mesh = lay, mesh
        self.compute_dtype = compute_dtype
        # Inside a pipeline the schedule runs backward outside loss_parallel(): gather.
        self.loss_parallel = loss_parallel and lay.tp > 1 and lay.pp == 1
        self.stage_index = mesh.get_local_rank("pp")
        module = split_stages(model, lay.pp)[self.stage_index] if lay.pp > 1 else model
        if lay.tp > 1:
            apply_tensor_parallel(module, mesh["tp"], lay.sequence_parallel, self.loss_parallel)
        fsdp_dtype = compute_dtype if lay.data != "ddp" else None
        self.module = apply_data_parallel(module, mesh, lay, reshard_after_forward, fsdp_dtype)
        # The data-parallel ranks: one group, or HSDP's two (summing over both sums over dp).
        self.dp_groups = [mesh[n].get_group() for n in ("replicate", "shard") if mesh[n].size() > 1]
        self.schedule = None
        if lay.pp > 1:
            from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

            device = next(model.parameters()).device
            stage = PipelineStage(
                self.module, self.stage_index, lay.pp, device, group=mesh["pp"].get_group()
            )
            # scale_grads divides the summed micro-batch gradients by their number:
            # the gradient of the mean over the whole slice.
            self.schedule = ScheduleGPipe(stage, microbatches, loss_fn=self.loss, scale_grads=True)

    @staticmethod
    def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy of ``[B, T, V]`` logits; 16-bit logits are upcast to float32
        first (the log-softmax over V in bfloat16 would round every probability)."""
        if logits.dtype in (torch.bfloat16, torch.float16):
            logits = logits.float()
        return functional.cross_entropy(logits.flatten(0, 1), targets.flatten())

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy of this slice, on vocabulary shards under loss parallelism."""
        from torch.distributed.tensor.parallel import loss_parallel

        if not self.loss_parallel:
            return self.cross_entropy(logits, targets)
        with loss_parallel():
            return self.cross_entropy(logits, targets)

    def autocast(self):
        """``torch.autocast`` to ``compute_dtype`` for DDP's forward; a no-op otherwise."""
        if getattr(self, "compute_dtype", None) is None or self.layout.data != "ddp":
            return contextlib.nullcontext()  # also for subclasses that set up their own layout
        device_type = next(self.module.parameters()).device.type
        return torch.autocast(device_type, dtype=self.compute_dtype)

    def forward_backward(self, x: torch.Tensor, y: torch.Tensor) -> float:
        """Forward and backward of this rank's slice ``int64 [B/dp, T]``; the global mean loss.

        Raises:
            ValueError: an empty slice.

        Returns:
            The loss of the whole global batch (the mean over data-parallel ranks of
            the slices' means, equal since the slices hold equal token counts), on every rank.
        """
        from torch.distributed.tensor.parallel import loss_parallel

        self._check_slice(x)
        if self.schedule is not None:
            return self._global_mean(self._pipeline_loss(self.schedule.step, x, y))
        if self.loss_parallel:
            with loss_parallel():
                loss = self.cross_entropy(self.module(x), y)
                loss.backward()
        else:
            with self.autocast():
                loss = self.loss(self.module(x), y)
            loss.backward()
        return self._global_mean(loss)

    def evaluate(self, x: torch.Tensor, y: torch.Tensor) -> float:
        """The loss of this rank's slice ``int64 [B/dp, T]`` without gradients (a
        validation loss): forward only, in ``eval()`` mode, under ``torch.no_grad()``.

        FSDP2 keeps the root's parameters gathered after a forward until its backward
        (:func:`apply_data_parallel`); with no backward coming, every FSDP module is
        resharded here, so the next training step starts as it would have without this call.

        Raises:
            ValueError: an empty slice.

        Returns:
            The mean loss of the whole global batch, as :meth:`forward_backward` returns it,
            the same float on every rank.
        """
        from torch.distributed.fsdp import FSDPModule
        from torch.distributed.tensor.parallel import loss_parallel

        self._check_slice(x)
        was_training = self.module.training
        self.module.eval()
        try:
            with torch.no_grad():
                if self.schedule is not None:
                    loss = self._pipeline_loss(self.schedule.eval, x, y)
                elif self.loss_parallel:
                    with loss_parallel():
                        loss = self.cross_entropy(self.module(x), y)
                else:
                    with self.autocast():
                        loss = self.loss(self.module(x), y)
        finally:
            self.module.train(was_training)
        for module in self.module.modules():
            if isinstance(module, FSDPModule):
                module.reshard()
        return self._global_mean(loss)

    @staticmethod
    def _check_slice(x: torch.Tensor) -> None:
        if x.shape[0] == 0:
            # An empty slice would leave this rank out of its groups' collectives: a hang.
            raise ValueError(
                "this rank's slice of the batch is empty: give every "
                "data-parallel rank at least one sequence"
            )

    def _pipeline_loss(self, run, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The slice's mean loss through the schedule's ``run`` (``step`` or ``eval``), on
        every stage: the last stage knows it, the pipeline group shares it."""
        first, last = self.stage_index == 0, self.stage_index == self.layout.pp - 1
        losses = []
        run(*([x] if first else []), target=y if last else None, losses=losses if last else None)
        local = (
            torch.stack(losses).mean().detach() if last else torch.zeros((), dtype=torch.float64)
        )
        local = local.to(torch.float64).to(x.device)
        dist.all_reduce(local, group=self.mesh["pp"].get_group())
        return local

    def _global_mean(self, loss: torch.Tensor) -> float:
        """The mean over the data-parallel ranks of this slice's loss (a DTensor is read
        whole first), in float64."""
        local = loss.detach()
        local = (local.full_tensor() if hasattr(local, "full_tensor") else local).to(torch.float64)
        for group in self.dp_groups:
            dist.all_reduce(local, group=group)
        return (local / self.layout.dp).item()

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Whole parameters this rank's stage holds, by the unsplit model's names (a collective)."""
        out = {}
        for name, p in self.module.named_parameters():
            name = name.removeprefix("module.")
            out[name] = (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
        return out
