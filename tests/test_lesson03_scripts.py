"""Lesson 03's scripts under torchrun and as plain python: init methods, subgroups, sockets."""

import ipaddress

from ddp_course import launch


def test_process_groups_meet_three_ways_with_two_ranks(root):
    job = launch.torchrun(root / "scripts/03_process_groups.py", nproc=2, results=True,
                          echo=False)  # fmt: skip
    r = job.results
    assert list(r["init"]) == ["env://", "tcp://", "file://"]
    assert all(got["sum"] == 3 for got in r["init"].values()), r["init"]
    added = r["added_by_launcher"]
    assert {"RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"} <= set(added)
    # The launcher keeps a single-node job on loopback: stores and gloo alike.
    assert {"agent", "rank 0", "rank 1"} <= {s["process"] for s in r["listening"]}
    assert all(ipaddress.ip_address(s["address"]).is_loopback for s in r["listening"])


def test_process_groups_as_plain_python(root):
    job = launch.python(root / "scripts/03_process_groups.py", results=True, echo=False)
    r = job.results
    assert r["world_size"] == 1
    assert all(got["sum"] == 1 for got in r["init"].values()), r["init"]


def test_collectives_subgroups_with_three_ranks(root):
    job = launch.torchrun(root / "scripts/03_collectives.py", nproc=3, results=True,
                          echo=False)  # fmt: skip
    subs = [record["subgroup"] for record in job.results["ranks"]]
    assert [s["members"] for s in subs] == [[0, 2], [1], [0, 2]]
    assert [s["sum"] for s in subs] == [2, 1, 2]  # each half's ranks, not the world's 3
    assert [s["rank_in_group"] for s in subs] == [0, 0, 1]
