"""ddp_course.comm_cost: the bytes each rank should move, from the formulas.

What the algorithms really count is compared with these functions in
test_collectives.py (several processes) and in notebook 04.
"""

import pytest

from ddp_course.comm_cost import CommStats, parameter_server_bytes, ring_bytes


@pytest.mark.parametrize("n", [2, 3, 4, 8])
def test_ring_bytes_equal_the_bandwidth_optimal_formula(n):
    numel, esize = 840 * n, 4  # a multiple of n
    k = numel * esize
    for rank in range(n):
        stats = ring_bytes(numel, esize, n, rank)
        assert stats.bytes_sent == stats.bytes_received == 2 * (n - 1) * k // n
        assert stats.steps == 2 * (n - 1)


@pytest.mark.parametrize("numel", [1, 2, 7, 1001])
@pytest.mark.parametrize("n", [2, 3, 4, 5])
def test_ring_bytes_for_odd_lengths_average_to_the_formula(numel, n):
    per_rank = [ring_bytes(numel, 8, n, r) for r in range(n)]
    k = numel * 8
    # Every byte sent is received: the totals match, and their mean is the formula.
    assert sum(s.bytes_sent for s in per_rank) == sum(s.bytes_received for s in per_rank)
    assert sum(s.bytes_sent for s in per_rank) == 2 * (n - 1) * k
    assert all(abs(s.bytes_sent - 2 * (n - 1) * k / n) < 2 * 8 for s in per_rank)


def test_parameter_server_bytes_at_server_and_worker():
    k = 1000 * 4
    for n in (2, 3, 4, 8):
        server = parameter_server_bytes(1000, 4, n, rank=0)
        assert server.bytes_sent == server.bytes_received == (n - 1) * k
        assert server.bytes_total == 2 * (n - 1) * k
        worker = parameter_server_bytes(1000, 4, n, rank=n - 1)
        assert worker.bytes_sent == worker.bytes_received == k
    assert parameter_server_bytes(1000, 4, 3, rank=2, root=2).bytes_sent == 2 * k
    assert parameter_server_bytes(1000, 4, 1, rank=0) == CommStats()


def test_byte_formulas_reject_bad_ranks():
    with pytest.raises(ValueError, match="rank 3"):
        ring_bytes(10, 4, 3, 3)
    with pytest.raises(ValueError, match="root"):
        parameter_server_bytes(10, 4, 3, 0, root=-1)
    with pytest.raises(ValueError, match="element_size"):
        ring_bytes(10, 0, 3, 0)


def test_comm_stats_add():
    total = CommStats(1, 2, 3) + CommStats(10, 20, 30)
    assert total == CommStats(11, 22, 33)
    assert total.bytes_total == 33
