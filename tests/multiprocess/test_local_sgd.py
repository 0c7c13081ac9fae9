"""DiLoCo and local SGD from scratch (ddp_course.local_sgd): equal to DDP at H=1, every rank
identical after each synchronisation, one all-reduce of every parameter per
synchronisation; broken variants (pseudo-gradient sign, averaging over a group of one, a
rank that does not load the synchronised copy) fail the same checks. One process: the
outer step's formula and the errors."""

import pytest
import torch
import worker_jobs

from ddp_course.local_sgd import DiLoCo, local_sgd

job = worker_jobs.worker_fixture("local_sgd_check.py", [], world_sizes=[2, 3])
TOL = 1e-12


def test_diloco_at_h1_with_sgd_inside_and_lr1_outside_is_ddp(job):
    assert job["h1_vs_ddp"] <= TOL


def test_the_broken_sign_is_not_ddp(job):
    assert job["wrong_sign_vs_ddp"] > 1e-3


def test_every_rank_holds_the_same_parameters_after_each_sync_and_not_between(job):
    h3 = job["h3"]
    assert h3["syncs"] == 2 and h3["after_sync"] == [0.0, 0.0]
    assert min(h3["between"]) > 1e-3  # the ranks drift apart on their own batches


def test_one_all_reduce_of_every_parameter_per_sync(job):
    h3 = job["h3"]
    assert h3["all_reduces"] == [h3["param_bytes"]] * h3["syncs"]


def test_local_sgd_is_diloco_with_outer_sgd_lr1(job):
    assert job["local_sgd_vs_diloco_lr1"] <= TOL


@pytest.mark.parametrize("broken", ["group_of_one_after_sync", "no_load_after_sync"])
def test_averaging_over_the_wrong_group_or_not_loading_leaves_ranks_apart(job, broken):
    assert min(job[broken]) > 1e-3


def test_the_outer_steps_are_nesterov_sgd_on_the_pseudo_gradients():
    """One worker, two synchronisations, against the algorithm written out: the second
    outer step starts from the first one's result and carries its momentum."""
    lr, momentum, h = 0.7, 0.9, 2
    x = torch.randn(4, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(1))

    def inner_steps(model):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(h):
            model(x).square().sum().backward()
            opt.step()
            opt.zero_grad()

    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2).double()
    torch.manual_seed(0)
    twin = torch.nn.Linear(3, 2).double()
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    outer = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum, nesterov=True)
    with DiLoCo(model, inner, outer, sync_every=h) as d:
        for _ in range(2 * h):
            model(x).square().sum().backward()
            inner.step()
            inner.zero_grad()
    assert d.syncs == 2 and d.inner_steps == 2 * h
    synced = [p.detach().clone() for p in twin.parameters()]
    buffers = None
    for _ in range(2):
        inner_steps(twin)
        g = [s - p.detach() for s, p in zip(synced, twin.parameters())]
        buffers = g if buffers is None else [momentum * b + gi for b, gi in zip(buffers, g)]
        synced = [s - lr * (gi + momentum * b) for s, gi, b in zip(synced, g, buffers)]
        with torch.no_grad():
            for p, s in zip(twin.parameters(), synced):
                p.copy_(s)
    for p, s in zip(model.parameters(), synced):
        torch.testing.assert_close(p.detach(), s, rtol=0, atol=1e-14)


def test_local_sgd_alone_changes_nothing():
    torch.manual_seed(0)
    a = torch.nn.Linear(3, 2).double()
    b = torch.nn.Linear(3, 2).double()
    b.load_state_dict(a.state_dict())
    x = torch.randn(4, 3, dtype=torch.float64)
    opt_a, opt_b = torch.optim.SGD(a.parameters(), lr=0.1), torch.optim.SGD(b.parameters(), lr=0.1)
    with local_sgd(a, opt_a, sync_every=2):
        for _ in range(5):
            for m, o in ((a, opt_a), (b, opt_b)):
                m(x).square().sum().backward()
                o.step()
                o.zero_grad()
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-15)


def test_bad_arguments_are_refused():
    model, other = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="sync_every"):
        DiLoCo(model, inner, torch.optim.SGD(model.parameters(), lr=1.0), sync_every=0)
    with pytest.raises(ValueError, match="outer optimizer"):
        DiLoCo(model, inner, torch.optim.SGD(other.parameters(), lr=1.0), sync_every=1)


def test_streaming_diloco_with_one_fragment_is_diloco(job):
    assert job["streaming_p1_vs_diloco"] == 0.0


def test_streaming_diloco_synchronises_its_fragments_in_turn(job):
    steps, sizes = job["streaming_p2"]["steps"], job["streaming_p2"]["fragment_bytes"]
    assert [s["synced"] for s in steps] == [None, 0, None, 1] * 2  # every H/P = 2 steps
    for s in steps:
        if s["synced"] is None:
            assert s["bytes"] == []
            continue
        assert s["bytes"] == [sizes[s["synced"]]]  # one all-reduce of that fragment only
        assert s["spread"][s["synced"]] == 0.0  # one model there, right after its sync
        assert s["spread"][1 - s["synced"]] > 1e-4  # the other fragment is apart
    assert sum(sizes) == job["h3"]["param_bytes"] and min(sizes) > 0


def test_a_streaming_diloco_stuck_on_one_fragment_never_synchronises_the_other(job):
    steps = job["streaming_stuck"]["steps"]
    assert all(s["spread"][1] > 1e-4 for s in steps)  # never one model in fragment 1
