"""monitor: per-rank rows, JSON and TensorBoard round trips, straggler detection."""

import json

import pytest
import torch

from ddp_course.runtime import DistContext
from ddp_course.tools import monitor


def test_rows_hold_timed_sections_and_rates():
    metrics = monitor.RankMetrics(rank=1)
    for step in range(2):
        with metrics.step(step, samples=8) as row:
            with metrics.timed(row, "local_s"):
                sum(range(1000))
            with metrics.timed(row, "local_s"):  # a second section of the same name adds up
                sum(range(1000))
            row["loss"] = 0.5
    assert [r["step"] for r in metrics.rows] == [0, 1]
    for row in metrics.rows:
        assert 0 < row["local_s"] <= row["step_time_s"]
        assert row["samples_per_s"] == pytest.approx(8 / row["step_time_s"])
        assert row["memory_bytes"] > 10 * 2**20  # a Python process with torch holds > 10 MiB
    with pytest.raises(ValueError, match="samples"):
        with metrics.step(2, samples=-1):
            pass


def test_gather_without_a_group_is_this_ranks_rows():
    metrics = monitor.RankMetrics(0)
    with metrics.step(0, samples=1):
        pass
    assert monitor.gather_metrics(metrics, DistContext()) == [metrics.rows]


def _per_rank():
    return [
        [{"step": s, "step_time_s": 0.1 * (r + 1) + s, "loss": 1.0 / (s + 1)} for s in range(3)]
        for r in range(2)
    ]


def test_json_round_trip(tmp_path):
    path = monitor.write_json(tmp_path / "sub" / "m.json", _per_rank())
    assert json.loads(path.read_text())["ranks"] == _per_rank()


def test_tensorboard_round_trip(tmp_path):
    monitor.write_tensorboard(tmp_path, _per_rank())
    scalars = monitor.read_tensorboard(tmp_path)
    assert set(scalars) == {f"{k}/rank_{r}" for k in ("step_time_s", "loss") for r in (0, 1)}
    steps, values = zip(*scalars["step_time_s/rank_1"])
    assert steps == (0, 1, 2)
    torch.testing.assert_close(list(values), [0.2, 1.2, 2.2])  # float32 in the event file
    with pytest.raises(FileNotFoundError, match="no TensorBoard event file"):
        monitor.read_tensorboard(tmp_path / "empty")


def test_find_stragglers():
    even = [[0.010, 0.011, 0.012], [0.011, 0.010, 0.013], [0.012, 0.011, 0.010]]
    assert monitor.find_stragglers(even) == []
    slow = [even[0], [0.061, 0.060, 0.2], even[2]]
    assert monitor.find_stragglers(slow) == [1]
    one_bad_step = [even[0], [0.011, 0.9, 0.012], even[2]]  # medians ignore one stall
    assert monitor.find_stragglers(one_bad_step) == []
    tiny = [[1e-4] * 3, [3e-4] * 3]  # 3x slower, but 0.2 ms is noise
    assert monitor.find_stragglers(tiny) == []
    assert monitor.find_stragglers(tiny, min_excess_s=0) == [1]


@pytest.mark.parametrize(
    ("times", "kwargs", "match"),
    [
        ([[0.1]], {}, "at least 2 ranks"),
        ([[0.1], []], {}, "at least one step"),
        ([[0.1], [0.1]], {"factor": 1.0}, "factor > 1"),
    ],
)
def test_find_stragglers_rejects_bad_input(times, kwargs, match):
    with pytest.raises(ValueError, match=match):
        monitor.find_stragglers(times, **kwargs)
