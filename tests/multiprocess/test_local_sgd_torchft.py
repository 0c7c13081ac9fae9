"""The course's DiLoCo from scratch (ddp_course.local_sgd) against torchft's
(torchft.local_sgd.DiLoCo) on 2 ranks, each a torchft replica group of one process, in
float64 on the same batches (tests/workers/torchft_diloco_check.py says which conventions
make them comparable): the same parameters after every inner step, every rank identical
after each synchronisation, every synchronisation committed, and torchft's servers on
loopback only, gone at the end."""

import importlib.util
import ipaddress

import pytest
import worker_jobs

# Not imported here: torchft reads RUST_LOG once, when first imported (torchft_loopback).
if importlib.util.find_spec("torchft") is None:
    pytest.skip(
        "torchft is in the pinned extra, for Python < 3.13 (no wheel for 3.13+)",
        allow_module_level=True,
    )

job = worker_jobs.worker_fixture("torchft_diloco_check.py", [], world_sizes=[2])
TOL = 1e-12


def test_the_runs_synchronise_twice_and_train(job):
    assert job["sync_steps"] == [2, 5] and job["course_syncs"] == 2
    assert job["moved_from_init"] > 1e-3  # not a comparison of untouched parameters


def test_torchft_diloco_equals_the_course_diloco_after_every_sync(job):
    assert max(job["ft_vs_course_after_sync"]) <= TOL


def test_torchft_diloco_equals_the_course_diloco_between_syncs(job):
    assert max(job["ft_vs_course_between"]) <= TOL


@pytest.mark.parametrize("which", ["course", "torchft"])
def test_every_rank_holds_the_same_parameters_after_each_sync_and_not_between(job, which):
    assert job[f"ranks_{which}_after_sync"] == [0.0, 0.0]
    assert min(job[f"ranks_{which}_between"]) > 1e-3  # the ranks drift on their own batches


def test_every_sync_is_committed_by_both_replicas(job):
    assert job["committed_steps"] == [2, 2]
    assert job["participants"] == [2, 2]


def test_torchft_listens_on_loopback_only_and_nothing_is_left(job):
    assert job["lighthouse_listening"]
    for rank, seen in job["listeners"].items():
        during = seen["listeners_during"]
        assert len(during) > len(seen["listeners_before"]), rank  # torchft's servers
        every = during + job["lighthouse_listening"] + seen["listeners_after"]
        assert all(ipaddress.ip_address(ip).is_loopback for ip, _ in every), (rank, every)
        assert seen["listeners_after"] == seen["listeners_before"], rank
