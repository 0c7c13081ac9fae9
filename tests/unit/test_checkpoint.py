"""A checkpoint saved from a plain, a DataParallel or a DDP model loads into
each of the others through ddp_course.checkpoint; loading naively fails with
the ``module.`` prefix error."""

import itertools

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_course.checkpoint import load_checkpoint, portable_state_dict, save_checkpoint, unwrap
from ddp_course.harness import launch
from ddp_course.models import SmallCNN

KINDS = ["plain", "dataparallel", "ddp"]


def build(kind: str, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    model = SmallCNN()
    if kind == "dataparallel":
        return nn.DataParallel(model)
    if kind == "ddp":
        return DDP(model)
    return model


def same_parameters(a: nn.Module, b: nn.Module) -> None:
    sa, sb = unwrap(a).state_dict(), unwrap(b).state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        torch.testing.assert_close(sa[k], sb[k], rtol=0, atol=0)


@pytest.mark.parametrize("src, dst", list(itertools.product(KINDS, KINDS)))
@pytest.mark.parametrize("how", ["save_checkpoint", "raw_state_dict"])
def test_loads_across_wrappers(group, tmp_path, src, dst, how):
    source, target = build(src, seed=1), build(dst, seed=2)
    with pytest.raises(AssertionError):
        same_parameters(source, target)  # different before loading
    path = tmp_path / "model.pt"
    if how == "save_checkpoint":
        save_checkpoint(group, path, source, epoch=3)
    else:
        torch.save(source.state_dict(), path)  # what people do: prefix and all
    extra = load_checkpoint(path, target)
    same_parameters(source, target)
    assert extra == ({"epoch": 3} if how == "save_checkpoint" else {})


def test_save_checkpoint_writes_no_prefix(group, tmp_path):
    save_checkpoint(group, tmp_path / "m.pt", build("ddp", 0))
    state = torch.load(tmp_path / "m.pt", weights_only=True)["model"]
    assert not any(k.startswith("module.") for k in state)


@pytest.mark.parametrize("src", ["dataparallel", "ddp"])
def test_naive_load_shows_the_prefix_error(group, src):
    wrapped = build(src, 0)
    with pytest.raises(RuntimeError) as info:
        SmallCNN().load_state_dict(wrapped.state_dict())
    message = str(info.value)
    assert "Unexpected key(s) in state_dict" in message
    assert '"module.features.0.weight"' in message
    assert 'Missing key(s) in state_dict: "features.0.weight"' in message
    # The other way round fails too: a wrapper expects the prefix.
    with pytest.raises(RuntimeError, match='Missing key\\(s\\) in state_dict: "module.'):
        wrapped.load_state_dict(SmallCNN().state_dict())
    # The fix, by hand: strip the prefix.
    SmallCNN().load_state_dict(portable_state_dict(wrapped.state_dict()))


def test_a_compiled_model_is_unwrapped_without_compiling(group, tmp_path):
    torch.manual_seed(3)
    model = SmallCNN()
    compiled = torch.compile(model)  # nothing compiles until the first call
    assert unwrap(compiled) is model
    assert unwrap(DDP(compiled)) is model and unwrap(nn.DataParallel(compiled)) is model
    assert all(k.startswith("_orig_mod.") for k in compiled.state_dict())
    save_checkpoint(group, tmp_path / "c.pt", compiled)
    state = torch.load(tmp_path / "c.pt", weights_only=True)["model"]
    assert state.keys() == model.state_dict().keys()  # no _orig_mod. in the file
    target = build("plain", seed=4)
    load_checkpoint(tmp_path / "c.pt", target)
    same_parameters(model, target)


@pytest.mark.parametrize("prefix", ["_orig_mod.", "module._orig_mod.", "_orig_mod.module."])
def test_compiled_prefixes_are_stripped(group, tmp_path, prefix):
    source = build("plain", seed=5)
    saved = {prefix + k: v for k, v in source.state_dict().items()}
    with pytest.raises(RuntimeError, match="Unexpected key"):
        SmallCNN().load_state_dict(saved)
    assert portable_state_dict(saved).keys() == source.state_dict().keys()
    torch.save(saved, tmp_path / "raw.pt")
    for kind in KINDS:
        target = build(kind, seed=6)
        load_checkpoint(tmp_path / "raw.pt", target)
        same_parameters(source, target)


# Two ranks: rank 0 writes slowly (a slow disk); every rank loads the checkpoint the moment
# its own save_checkpoint call returns.
_READ_AT_ONCE = """
import argparse
import time

import torch

from ddp_course.checkpoint import load_checkpoint, save_checkpoint
from ddp_course.runtime import distributed
from ddp_course.tools.records import write_results

parser = argparse.ArgumentParser()
parser.add_argument("path")
parser.add_argument("--results")
args = parser.parse_args()
real_save = torch.save


def slow_save(*save_args, **kwargs):
    time.sleep(2.0)  # meanwhile rank 1 has reached the end of its save_checkpoint call
    real_save(*save_args, **kwargs)


torch.save = slow_save
with distributed() as ctx:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    save_checkpoint(ctx, args.path, model, epoch=7)
    target = torch.nn.Linear(4, 2)  # other weights: the load must bring rank 0's
    extra = load_checkpoint(args.path, target)
    same = all(torch.equal(a, b) for a, b in zip(model.parameters(), target.parameters()))
    records = [None] * ctx.world_size
    torch.distributed.all_gather_object(records, [extra, same])
    write_results(ctx, args.results, {"ranks": records})
"""


def test_no_rank_reads_the_checkpoint_before_it_is_complete(tmp_path):
    worker = tmp_path / "read_at_once.py"
    worker.write_text(_READ_AT_ONCE)
    path = tmp_path / "ckpt" / "model.pt"
    job = launch.torchrun(
        worker, [str(path)], nproc=2, gpus=0, results=True, echo=False, timeout_s=180
    )
    assert len(job.results["ranks"]) == 2
    for extra, same in job.results["ranks"]:
        assert extra == {"epoch": 7} and same  # the whole checkpoint, on every rank
