"""ddp_course.tools.trace: interval arithmetic and the overlap of all-reduce with backward, on
hand-made traces with known answers and on the trace recorded by scripts/10_benchmark.py."""

import json

import pytest

from ddp_course.tools.trace import (
    intersection,
    intervals,
    load_trace,
    overlap_report,
    slim_trace,
    total_length,
    union,
)


def ev(name, ts, dur, tid=1, pid=7, cat="user_annotation"):
    return {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur, "pid": pid, "tid": tid}


def test_union_and_intersection_by_hand():
    assert union([(5, 8), (0, 2), (1, 3), (8, 9)]) == [(0, 3), (5, 9)]
    assert total_length([(0, 2), (1, 3), (10, 11)]) == 4
    assert intersection([(0, 10)], [(2, 3), (5, 12)]) == [(2, 3), (5, 10)]
    assert intersection([(0, 1)], [(2, 3)]) == []
    with pytest.raises(ValueError, match="ends before"):
        union([(3, 1)])


def test_overlap_of_a_hand_made_trace():
    # Backward functions 0-50 and 50-100 us. Two gloo threads: 60-120 and 90-150 (together
    # 60-150, 90 us), of which 60-100 (40 us) overlaps backward; the launch op is not counted,
    # nor the "backward" label, which lasts until DDP has waited for every bucket (150 us).
    bw = "autograd::engine::evaluate_function: AddmmBackward0"
    events = [
        ev("backward", 0, 150),
        ev(bw, 0, 50, cat="cpu_op"),
        ev(bw, 50, 50, cat="cpu_op"),
        ev("gloo:all_reduce", 60, 60, tid=2),
        ev("gloo:all_reduce", 90, 60, tid=3),
        ev("c10d::allreduce_", 59, 1, cat="cpu_op"),
        ev("optimizer", 150, 10),
        {"ph": "M", "name": "thread_name", "pid": 7, "tid": 2, "args": {"name": "gloo"}},
    ]
    r = overlap_report(events)
    assert (r["comm_us"], r["compute_us"], r["overlap_us"]) == (90, 100, 40)
    assert r["overlap_fraction"] == pytest.approx(40 / 90)
    # Another rank's events in the same file are left out when pid is given.
    other = [ev("gloo:all_reduce", 0, 100, pid=8, tid=2)]
    assert overlap_report(events + other, pid=7) == r
    # Without pid: comm 0-150 us, of which 0-100 under backward.
    assert overlap_report(events + other)["overlap_fraction"] == pytest.approx(100 / 150)
    # Against the label instead, every bit of communication would look hidden.
    assert overlap_report(events, compute="^backward$")["overlap_fraction"] == 1.0
    with pytest.raises(ValueError, match="record_function"):
        overlap_report(events, compute="^no such label$")
    with pytest.raises(ValueError, match="communication"):
        overlap_report([ev(bw, 0, 1)])


def test_slim_trace_keeps_labels_comm_and_thread_names(tmp_path):
    thread = {"ph": "M", "name": "thread_name", "pid": 7, "tid": 2, "args": {"name": "x"}}
    bw = "autograd::engine::evaluate_function: MmBackward0"
    events = [
        ev("backward", 0, 100),
        ev(bw, 0, 90, cat="cpu_op"),
        ev("gloo:all_reduce", 60, 60, tid=2),
        ev("aten::mm", 1, 2, cat="cpu_op"),
        ev("Optimizer.step#SGD.step", 1, 2),
        thread,
    ]
    slim = slim_trace(events)
    names = [e["name"] for e in slim["traceEvents"]]
    assert names == ["backward", bw, "gloo:all_reduce", "thread_name"]
    path = tmp_path / "t.json"
    path.write_text(json.dumps(slim))
    assert overlap_report(load_trace(path)) == overlap_report(events)
    path.write_text(json.dumps(slim["traceEvents"]))  # a bare list is a trace too
    assert len(load_trace(path)) == 4
    path.write_text("{}")
    with pytest.raises(ValueError, match="traceEvents"):
        load_trace(path)
    assert intervals(events, "^gloo:") == [(60.0, 120.0)]


def test_the_recorded_trace_gives_the_recorded_overlap(root):
    # benchmarks/cpu-2core holds rank 0's trace of torch's DDP and the numbers the same run
    # reported: reading the file again must give them, and the no-overlap setting none.
    folder = root / "benchmarks/cpu-2core"
    record = json.loads((folder / "10_knobs_model_trace.json").read_text())
    rows = {r["setting"]: r for r in record["rows"] if r["mode"] == "trace"}
    got = overlap_report(load_trace(folder / "10_trace_rank0.json"))
    want = rows["torch DDP cap=1"]
    assert got == pytest.approx({k: want[k] for k in got})
    assert 0 < got["overlap_fraction"] < 1
    assert rows["BucketedDDP cap=1 no overlap"]["overlap_us"] == 0
