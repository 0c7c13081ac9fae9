"""Local SGD and DiLoCo: train alone for H steps, then average what changed.

Data parallelism all-reduces the gradients after every step. *Local SGD* lets
every worker take ``H`` optimizer steps on its own data and then averages the
parameters (Stich, "Local SGD converges fast and communicates little", ICLR
2019, https://arxiv.org/abs/1805.09767): ``H`` times fewer all-reduces, the
same bytes each. *DiLoCo* (Douillard et al., "DiLoCo: Distributed
Low-Communication Training of Language Models", 2023,
https://arxiv.org/abs/2311.08105) generalises the average into an optimizer
step: every ``H`` inner steps (AdamW in the paper) each worker computes its
*pseudo-gradient*, the parameters at the last synchronisation minus its own
now, the workers average it, and an *outer* optimizer (SGD with Nesterov
momentum, learning rate 0.7, momentum 0.9 in the paper) steps the parameters
of the last synchronisation with it; every worker continues from the result.
With an outer SGD of learning rate 1 and no momentum, the outer step lands on
the average of the workers' parameters: local SGD. With ``H = 1`` and an inner
SGD as well, it is data parallelism: the average of one SGD step from the same
point is one SGD step with the average gradient.

The outer optimizer is built on the model's own parameters, as in torchft's
``torchft.local_sgd.DiLoCo``: at a synchronisation the parameters are set
back to the last synchronisation's values, their ``.grad`` to the averaged
pseudo-gradient, and the outer optimizer steps them.

*Streaming DiLoCo* (Douillard et al., "Streaming DiLoCo with overlapping
communication: Towards a Distributed Free Lunch", 2025,
https://arxiv.org/abs/2501.18512) splits the parameters into ``P`` fragments and
synchronises them in turn, each still every ``H`` steps but at offsets ``H/P``
apart: the same bytes over ``H`` steps, in ``P`` all-reduces each ``P`` times
smaller, so the peak bandwidth a synchronisation needs falls by ``P``. (The paper
also overlaps each fragment's all-reduce with the next inner steps and sends it
in 4 bits; :class:`StreamingDiLoCo` does neither.)
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["DiLoCo", "StreamingDiLoCo", "local_sgd"]


class DiLoCo:
    """Synchronise a model every ``sync_every`` inner optimizer steps (DiLoCo).

    Used as a context manager around an ordinary training loop::

        with DiLoCo(model, inner, outer, sync_every=50):
            for x, y in batches:
                loss_fn(model(x), y).backward()
                inner.step()        # every 50th call also synchronises
                inner.zero_grad()

    Inside the block, each call of ``inner_optimizer.step()`` is counted (a step
    post-hook, ``torch.optim.Optimizer.register_step_post_hook``); after every
    ``sync_every``-th, :meth:`sync` runs. Every rank of ``group`` must enter the
    block with the same parameters (the same seed, or loaded from one checkpoint)
    and step as often as the others.

    Args:
        model: the worker's model; its parameters (any dtype, one device) are
            the ones both optimizers step.
        inner_optimizer: steps the model on this worker's own batches.
        outer_optimizer: built on ``model.parameters()``; steps the parameters of
            the last synchronisation with the averaged pseudo-gradient.
        sync_every: H, inner steps between synchronisations, >= 1.
        group: the process group to average over (default: every rank; none
            initialised: a single worker, no communication).

    Attributes:
        inner_steps: inner steps taken inside the block so far.
        syncs: synchronisations so far.

    Raises:
        ValueError: ``sync_every < 1``, or an outer optimizer that holds a
            parameter the model does not have.
    """

    def __init__(
        self,
        model: nn.Module,
        inner_optimizer: torch.optim.Optimizer,
        outer_optimizer: torch.optim.Optimizer,
        sync_every: int,
        group: dist.ProcessGroup | None = None,
    ):
        if sync_every < 1:
            raise ValueError(f"sync_every must be at least 1, not {sync_every}")
        self.params = [p for p in model.parameters() if p.requires_grad]
        mine = {id(p) for p in self.params}
        outer = [p for g in outer_optimizer.param_groups for p in g["params"]]
        if any(id(p) not in mine for p in outer):
            raise ValueError("build the outer optimizer on model.parameters(), as the inner one")
        self.inner, self.outer = inner_optimizer, outer_optimizer
        self.sync_every, self.group = sync_every, group
        self.inner_steps = self.syncs = 0
        self._handle = None
        self._last_sync: list[torch.Tensor] = []

    def __enter__(self) -> DiLoCo:
        self._last_sync = [p.detach().clone() for p in self.params]
        self._handle = self.inner.register_step_post_hook(self._after_inner_step)
        return self

    def __exit__(self, *exc) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    def _after_inner_step(self, optimizer, args, kwargs) -> None:
        self.inner_steps += 1
        if self.inner_steps % self.sync_every == 0:
            self.sync()

    def pseudo_gradients(self) -> list[torch.Tensor]:
        """Per parameter, the last synchronisation's value minus this worker's now
        (same shapes and dtypes as the parameters)."""
        return [last - p.detach() for last, p in zip(self._last_sync, self.params)]

    @torch.no_grad()
    def sync(self, indices: list[int] | None = None) -> None:
        """Average the pseudo-gradients over the group (one all-reduce of all of them,
        flattened), step the last synchronisation's parameters with the outer
        optimizer, and continue from the result.

        ``indices``: synchronise only ``self.params[i]`` for these ``i`` (a fragment of
        :class:`StreamingDiLoCo`); the others keep their values, their gradients and
        their outer optimizer state. Default: every parameter.
        """
        indices = range(len(self.params)) if indices is None else indices
        everything = self.pseudo_gradients()
        chosen = [(self.params[i], self._last_sync[i], everything[i]) for i in indices]
        flat = torch.cat([d.reshape(-1) for _, _, d in chosen])
        if dist.is_initialized():
            dist.all_reduce(flat, group=self.group)
            flat /= dist.get_world_size(self.group)
        picked = set(indices)
        others = [p for i, p in enumerate(self.params) if i not in picked]
        kept = [p.grad for p in others]
        for p in others:
            p.grad = None  # an optimizer skips a parameter without a gradient
        offset = 0
        for p, last, d in chosen:
            p.copy_(last)
            p.grad = flat[offset : offset + d.numel()].view_as(p).clone()
            offset += d.numel()
        self.outer.step()
        for p, last, _ in chosen:
            p.grad = None  # the inner optimizer's next step sees only its own gradient
            last.copy_(p)
        for p, g in zip(others, kept):
            p.grad = g
        self.syncs += 1


class StreamingDiLoCo(DiLoCo):
    """DiLoCo whose parameters are synchronised in ``fragments`` parts, in turn.

    Fragment ``f`` (0-based) holds consecutive parameters of ``model.parameters()``,
    about ``1/fragments`` of the elements each (a parameter is never split, so a large
    one makes its fragment larger), and is synchronised after inner steps
    ``(f + 1) * H / P``, then every ``H`` steps: every ``H / P`` inner steps one
    fragment is all-reduced, ``P`` times fewer bytes at once than DiLoCo sends, the same
    bytes over ``H`` steps (Douillard et al. 2025, without the overlap and the 4-bit
    all-reduce). With ``fragments=1`` it is :class:`DiLoCo`. Used as :class:`DiLoCo`.

    Args:
        fragments: P, >= 1, dividing ``sync_every``, at most the number of parameters.
        model, inner_optimizer, outer_optimizer, sync_every, group: as :class:`DiLoCo`.

    Attributes:
        fragments: per fragment, the indices of its parameters in ``model.parameters()``.
        syncs: fragment synchronisations so far.
        last_fragment: the fragment synchronised last, or None.

    Raises:
        ValueError: as :class:`DiLoCo`, or a fragment count that does not divide
            ``sync_every`` or exceeds the parameters.
    """

    def __init__(
        self,
        model: nn.Module,
        inner_optimizer: torch.optim.Optimizer,
        outer_optimizer: torch.optim.Optimizer,
        sync_every: int,
        fragments: int,
        group: dist.ProcessGroup | None = None,
    ):
        super().__init__(model, inner_optimizer, outer_optimizer, sync_every, group)
        if fragments < 1 or sync_every % fragments or fragments > len(self.params):
            raise ValueError(
                f"fragments must be at least 1, divide sync_every={sync_every} and not "
                f"exceed the {len(self.params)} parameters, not {fragments}"
            )
        total = sum(p.numel() for p in self.params)
        self.fragments: list[list[int]] = [[] for _ in range(fragments)]
        seen, f = 0, -1  # the first parameter goes to fragment 0
        for i, p in enumerate(self.params):
            # The fragment the parameter's middle element falls in, moving on by at most
            # one fragment a parameter (none left empty), and soon enough to fill the last.
            middle = (seen + p.numel() / 2) * fragments // total
            f = max(min(int(middle), f + 1), fragments - (len(self.params) - i))
            self.fragments[f].append(i)
            seen += p.numel()
        self.last_fragment: int | None = None

    def _after_inner_step(self, optimizer, args, kwargs) -> None:
        self.inner_steps += 1
        every = self.sync_every // len(self.fragments)
        if self.inner_steps % every == 0:
            f = (self.inner_steps // every - 1) % len(self.fragments)
            self.sync(self.fragments[f])
            self.last_fragment = f


def local_sgd(
    model: nn.Module,
    inner_optimizer: torch.optim.Optimizer,
    sync_every: int,
    group: dist.ProcessGroup | None = None,
) -> DiLoCo:
    """Local SGD (Stich 2019): average the parameters every ``sync_every`` inner steps.

    DiLoCo with an outer SGD of learning rate 1 and no momentum: its step from the
    last synchronisation ``x`` with the average pseudo-gradient ``x - mean(x_r)``
    lands on ``mean(x_r)``, the workers' average. Arguments and errors as
    :class:`DiLoCo`.
    """
    outer = torch.optim.SGD(model.parameters(), lr=1.0)
    return DiLoCo(model, inner_optimizer, outer, sync_every, group)
