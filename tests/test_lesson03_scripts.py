"""Lesson 03's scripts as plain python and with 3 ranks (subgroups); notebook 03 asserts
the 2-rank run of 03_process_groups.py (init methods, torchrun's variables, sockets)."""

from ddp_course import launch


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
