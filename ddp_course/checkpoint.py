"""Checkpoints that work across plain, DataParallel and DDP models.

Rules (https://pytorch.org/tutorials/intermediate/ddp_tutorial.html, section
"Save and Load Checkpoints"):

- save once, on rank 0, then ``barrier()`` so no rank reads a half-written
  file; write to a temporary file, ``fsync`` it, ``os.replace`` it onto the
  checkpoint and ``fsync`` the folder: a crash of the process at any point
  leaves the previous checkpoint or the new one, never a truncated file, and
  once the save returned the new one also survives a crash of the host (a
  power cut, a kernel panic) on a local file system that honours ``fsync``
  (a network file system may not: see its own guarantees);
- save the unwrapped module's state dict (no ``module.`` prefix, nor the
  ``_orig_mod.`` prefix of a ``torch.compile``'d model) and strip the
  prefixes when loading one saved from a wrapper;
- load with ``map_location`` onto this rank's device, and with
  ``weights_only=True`` (the default since torch 2.6): store tensors and
  plain Python values only;
- keep an optimizer's ``step`` counters on the host, as a new optimizer does:
  ``Optimizer.load_state_dict`` moves every other state tensor to its
  parameter's device but leaves ``step`` where ``map_location`` put it, unless
  the optimizer is ``fused`` or ``capturable`` (torch/optim/optimizer.py, note
  "special device hosting for step"); a ``step`` on the GPU makes every
  optimizer step wait for the GPU to read it back.
"""

from __future__ import annotations

import os
import pathlib
import pickle
import random
import tempfile
from typing import Any

import torch
from torch import nn
from torch.nn.modules.utils import consume_prefix_in_state_dict_if_present

from .runtime import DistContext, barrier

__all__ = [
    "load_checkpoint",
    "portable_state_dict",
    "restore_rng_states",
    "rng_states",
    "save_checkpoint",
    "steps_on_host",
    "unwrap",
]


# The prefixes wrappers put in front of the wrapped model's keys: DP and DDP
# keep it as ``.module``; torch.compile's OptimizedModule as ``._orig_mod``.
_WRAPPER_ATTRIBUTES = ("module", "_orig_mod")


def unwrap(model: nn.Module) -> nn.Module:
    """The model inside data-parallel and compile wrappers (or the model itself).

    A wrapper is any module that keeps the wrapped model as ``.module``
    (``nn.DataParallel``, DDP, the course's own ``data_parallel.DataParallel``) or
    as ``._orig_mod`` (``torch.compile``), nested in any order.
    """
    while True:
        inner = next(
            (
                getattr(model, name)
                for name in _WRAPPER_ATTRIBUTES
                if isinstance(getattr(model, name, None), nn.Module)
            ),
            None,
        )
        if inner is None or inner is model:
            return model
        model = inner


def portable_state_dict(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A copy of ``state`` without the ``module.`` prefix that DP and DDP add
    nor the ``_orig_mod.`` prefix of ``torch.compile``, nested in any order.

    Loads into a plain model; a DP or DDP model loads it into ``.module``.
    """
    state = dict(state)
    while True:
        before = list(state)
        for name in _WRAPPER_ATTRIBUTES:
            consume_prefix_in_state_dict_if_present(state, f"{name}.")
        if list(state) == before:
            return state


def save_checkpoint(
    ctx: DistContext,
    path: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    **extra: Any,
) -> None:
    """Save ``model`` (unwrapped), ``optimizer`` and ``extra`` on rank 0, atomically.

    Every rank must call this (it ends in a barrier). ``extra`` holds plain
    values such as ``epoch=3``, so the file loads with ``weights_only=True``.

    The bytes reach the disk before the rename (``fsync`` of the temporary
    file) and the rename reaches it before this returns (``fsync`` of the
    folder, on POSIX systems): without them ``os.replace`` survives a crash of
    the process but not of the host, after which the checkpoint can be empty
    or the old one. Not every file system honours ``fsync`` (some network file
    systems acknowledge it early).

    Raises:
        OSError: the folder cannot be created, or writing or syncing failed
            (a full disk); the previous checkpoint at ``path`` is then intact.
    """
    if ctx.is_main:
        path = pathlib.Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        payload = {"model": portable_state_dict(unwrap(model).state_dict()), **extra}
        if optimizer is not None:
            payload["optimizer"] = optimizer.state_dict()
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
        os.close(fd)
        try:
            torch.save(payload, tmp)
            _fsync_file(tmp)  # the data on disk before the rename can point at it
            os.replace(tmp, path)
            _fsync_folder(path.parent)  # the rename itself on disk
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)
    barrier(ctx)


def _fsync_file(path: str | os.PathLike) -> None:
    # torch.save closed the file: its bytes may still sit in the page cache.
    with open(path, "rb+") as handle:
        os.fsync(handle.fileno())


def _fsync_folder(folder: pathlib.Path) -> None:
    # A rename changes an entry of the folder: syncing the folder writes it.
    # Windows cannot open a folder with os.open; there the rename is not synced.
    if os.name != "posix":
        return
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def load_checkpoint(
    path: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    map_location: torch.device | str = "cpu",
) -> dict[str, Any]:
    """Load a checkpoint into a plain, DataParallel or DDP ``model``.

    Accepts files saved by :func:`save_checkpoint` and plain state dicts
    (with or without the ``module.`` prefix). Tensors are mapped onto
    ``map_location`` (this rank's device) and read with ``weights_only=True``.

    Returns:
        The checkpoint's other entries (e.g. ``{"epoch": 3}``).

    Raises:
        FileNotFoundError: if ``path`` does not exist.
        RuntimeError: if the file cannot be read as a checkpoint (truncated,
            corrupt, or holding objects ``weights_only`` refuses); the message
            names the file. Also if the keys or shapes do not match the model.
    """
    path = pathlib.Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no checkpoint at {path}")
    try:
        payload = torch.load(path, map_location=map_location, weights_only=True)
    except (RuntimeError, EOFError, ValueError, pickle.UnpicklingError) as exc:
        # torch's own message names neither the file nor what to do.
        raise RuntimeError(
            f"cannot load the checkpoint {path}: {exc}\nThe file is damaged (an interrupted "
            "copy?), is not a checkpoint, or holds objects that weights_only=True refuses "
            "(see above): save it again with tensors and plain values, or use another file."
        ) from exc
    if "model" not in payload:
        payload = {"model": payload}
    unwrap(model).load_state_dict(portable_state_dict(payload.pop("model")))
    opt_state = payload.pop("optimizer", None)
    if optimizer is not None and opt_state is not None:
        optimizer.load_state_dict(steps_on_host(opt_state))
    return payload


def steps_on_host(optimizer_state: dict[str, Any]) -> dict[str, Any]:
    """``optimizer_state`` (an ``Optimizer.state_dict()``) with every ``step``
    tensor moved to the CPU, as a new non-fused optimizer holds it (a 0-d
    float32 tensor on the host); ``Optimizer.load_state_dict`` moves it back to
    the parameter's device for a ``fused`` or ``capturable`` optimizer. Other
    entries are shared, not copied."""
    state = {
        key: {
            name: value.cpu() if name == "step" and torch.is_tensor(value) else value
            for name, value in per_param.items()
        }
        for key, per_param in optimizer_state.get("state", {}).items()
    }
    return {**optimizer_state, "state": state}


def rng_states() -> dict[str, Any]:
    """This process's random-number generators, to store in a snapshot.

    Returns:
        ``{"python": random.getstate(), "torch": uint8 CPU tensor,
        "cuda": [uint8 tensor per GPU]}`` (``cuda`` empty without CUDA): plain
        values and tensors only, so a snapshot holding them loads with
        ``weights_only=True``. NumPy's generator is not included (the course's
        scripts draw nothing from it after seeding).
    """
    return {
        "python": random.getstate(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }


def restore_rng_states(states: dict[str, Any]) -> None:
    """Set the generators back to what :func:`rng_states` returned.

    ``weights_only`` loading turns the Python state's tuples into lists;
    they are turned back here.

    Raises:
        KeyError: ``states`` lacks ``"python"`` or ``"torch"``.
    """
    version, internal, gauss = states["python"]
    random.setstate((version, tuple(internal), gauss))
    torch.set_rng_state(states["torch"].cpu())
    if states.get("cuda") and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([s.cpu() for s in states["cuda"]])
