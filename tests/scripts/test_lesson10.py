"""Lesson 10's benchmark with tiny settings: one 2-rank job of every mode, its rows checked
against the definitions (busbw, efficiency, the step-time model, the trace's overlap)."""

import csv
import json
import pathlib

import pytest

from ddp_course.harness import launch
from ddp_course.tools.bench import COLLECTIVES, AlphaBeta, busbw_factor, fit_each
from ddp_course.tools.scaling import (
    StepTimeModel,
    comm_can_overlap,
    compute_slowdown,
    efficiency_table,
)
from ddp_course.tools.trace import load_trace, overlap_report

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bench10")
    trace, out = tmp / "trace.json", tmp / "tiny.json"
    args = ["all", "--tiny", "--no-progress", "--chrome-trace", str(trace), "--results", str(out)]
    job = launch.torchrun(
        ROOT / "scripts/10_benchmark.py", args, nproc=2, echo=False, timeout_s=240
    )
    with open(out.with_suffix(".csv"), newline="") as f:
        csv_rows = list(csv.DictReader(f))
    return json.loads(out.read_text()), trace, csv_rows, job


def rows(results, mode):
    return [r for r in results["rows"] if r["mode"] == mode]


def test_records_say_how_they_were_made(tiny):
    r, *_ = tiny
    meta = r["meta"]
    assert meta["command"].startswith("torchrun --nproc_per_node=2 ")
    assert meta["command"].split()[2] == "scripts/10_benchmark.py"  # relative, as typed
    assert (meta["world_size"], meta["backend"]) == (2, "gloo")
    assert meta["load_average_1min"] is not None and meta["torch"]


def test_collectives_rows_follow_the_definitions(tiny):
    r, *_ = tiny
    got = rows(r, "collectives")
    assert sorted({g["collective"] for g in got}) == sorted(COLLECTIVES)
    assert sorted({g["bytes"] for g in got}) == [4096, 16384, 65536]
    for g in got:
        assert g["algbw_GBps"] == pytest.approx(g["bytes"] / g["median_s"] / 1e9)
        assert g["busbw_GBps"] == pytest.approx(g["algbw_GBps"] * busbw_factor(g["collective"], 2))
        assert g["repeats"] == 2
    fits = r["summary"]["collectives"]["fits"]
    for name, fit in fit_each(got).items():
        assert fits[name]["alpha_s"] == pytest.approx(fit.alpha)
        assert fits[name]["busbw_plateau_GBps"] == pytest.approx(
            fit.bandwidth * busbw_factor(name, 2) / 1e9
        )


def test_a_bandwidth_is_printed_only_where_the_sweep_reached_half_of_it(tiny):
    r, *_, job = tiny
    largest = max(g["bytes"] for g in rows(r, "collectives"))
    for name, fit in r["summary"]["collectives"]["fits"].items():
        line = next(s for s in job.output.splitlines() if f"{name}: alpha" in s)
        # beta > 0 and alpha / beta within the sweep (inf when beta is 0)
        resolved = fit["bandwidth_GBps"] > 0 and fit["half_bandwidth_bytes"] <= largest
        assert ("bandwidth not resolved" in line) != resolved, (line, fit)


def test_scaling_tables_come_from_the_rows(tiny):
    r, *_ = tiny
    got = [g for g in rows(r, "scaling") if g["threads_per_rank"] == 1]
    s = r["summary"]["scaling"]
    for kind in ("strong", "weak"):
        mine = sorted((g for g in got if g["kind"] == kind), key=lambda g: g["world_size"])
        assert [g["world_size"] for g in mine] == [1, 2]
        want = efficiency_table([1, 2], [g["median_s"] for g in mine], kind, 8)
        assert s[kind] == want  # JSON keeps floats exactly
        assert 0 <= s[f"{kind}_serial_fraction"] <= 1
    # The weak runs double the global batch; the strong ones keep it.
    assert {g["global_batch"] for g in got if g["kind"] == "strong"} == {8}
    assert {(g["world_size"], g["global_batch"]) for g in got if g["kind"] == "weak"} == {
        (1, 8),
        (2, 16),
    }
    assert any(g["oversubscribed"] for g in rows(r, "scaling"))


def test_knobs_ratios_are_of_the_rows(tiny):
    r, *_ = tiny
    med = {g["setting"]: g["median_s"] for g in rows(r, "knobs")}
    ratios = r["summary"]["knobs"]["ratios"]
    assert ratios["sync every micro-batch / no_sync"] == pytest.approx(
        med["sync every micro-batch"] / med["no_sync"]
    )
    assert ratios["BucketedDDP / torch DDP"] == pytest.approx(
        med["BucketedDDP cap=25"] / med["torch DDP cap=25"]
    )
    assert {"torch DDP cap=0.01", "torch DDP cap=1", "fp16 hook cap=25"} <= set(med)
    assert set(r["summary"]["knobs"]) == {"ratios"}  # every setting ran: none is skipped


def test_step_time_model_rows(tiny):
    r, *_ = tiny
    s = r["summary"]["model"]
    plain = sum(s["compute_s"].values())
    fit = AlphaBeta(s["all_reduce_fit"]["alpha_s"], 1e-9 / s["all_reduce_fit"]["bandwidth_GBps"])
    # The fit in the summary is the one of the all-reduce rows the run wrote.
    sweep = [g for g in rows(r, "model") if g["setting"] == "all_reduce"]
    again = fit_each(sweep, key="setting")["all_reduce"]
    assert (again.alpha, again.beta) == pytest.approx((fit.alpha, fit.beta))
    # Two ranks with one thread each: overlap and slow-down as the machine's cores decide.
    assert s["threads_per_rank"] == 1
    assert s["overlap"] == comm_can_overlap("cpu", 2, 1, s["cpus"])
    assert s["compute_slowdown"] == compute_slowdown("cpu", 2, 1, s["cpus"])
    for g in (g for g in rows(r, "model") if g["setting"] == "BucketedDDP"):
        assert g["bytes"] == s["gradient_bytes"]  # every gradient in some bucket
        # The compute terms are rank 0's alone, through the wrapper at world size 1: not the
        # plain model's, and not those timed with both ranks at once.
        alone = g["forward_s"] + g["backward_s"] + g["optimizer_s"]
        assert g["wrapper_s"] == pytest.approx(alone - plain)
        assert g["forward_s"] != s["compute_s"]["forward"]
        assert g["compute_together_s"] != alone
        buckets = s["bucket_bytes"][f"{g['bucket_cap_mb']:g}"]
        assert (len(buckets), sum(buckets)) == (g["buckets"], g["bytes"])
        # The prediction: one rank's compute, stretched by the share of the cores, plus the
        # buckets' all-reduce times from the fit.
        model = StepTimeModel(g["forward_s"], g["backward_s"], g["optimizer_s"], s["overlap"])
        model = model.slowed(s["compute_slowdown"])
        assert g["predicted_s"] == pytest.approx(model.predict(buckets, fit, 2))
        if not s["overlap"]:  # every bucket after backward
            comm = sum(max(0.0, float(fit.predict(b))) for b in buckets)
            assert g["exposed_comm_s"] == pytest.approx(comm)
            assert g["predicted_s"] == pytest.approx(g["no_overlap_s"])
        assert g["predicted_s"] == pytest.approx(
            s["compute_slowdown"] * alone + g["exposed_comm_s"]
        )
        assert g["without_wrapper_s"] == pytest.approx(
            g["predicted_s"] - s["compute_slowdown"] * g["wrapper_s"]
        )
        assert g["overlapped_s"] >= s["compute_slowdown"] * alone  # never below the compute
        assert g["predicted_over_measured"] == pytest.approx(g["predicted_s"] / g["median_s"])
    probe = s["overlap_probe"]
    assert probe["bucket_cap_mb"] == 1.0
    assert probe["ratio"] == pytest.approx(
        probe["no_overlap"]["median_s"] / probe["overlap"]["median_s"]
    )
    caps = {g["bucket_cap_mb"]: g["buckets"] for g in rows(r, "model") if "buckets" in g}
    assert caps[0.01] > caps[1.0] == 1  # a small cap cuts the 0.24 MB of gradients


def test_trace_overlap_and_the_kept_trace(tiny):
    r, trace, *_ = tiny
    got = {g["setting"]: g for g in rows(r, "trace")}
    assert set(got) == {"torch DDP cap=1", "BucketedDDP cap=1", "BucketedDDP cap=1 no overlap"}
    for g in got.values():
        assert 0 <= g["overlap_fraction"] <= 1 and g["comm_us"] > 0
    # Launched after backward, the all-reduces cannot overlap it.
    assert got["BucketedDDP cap=1 no overlap"]["overlap_us"] == 0
    # The file kept for a viewer gives the number the job reported.
    assert overlap_report(load_trace(trace)) == pytest.approx(
        {
            k: got["torch DDP cap=1"][k]
            for k in ("comm_us", "compute_us", "overlap_us", "overlap_fraction")
        }
    )
    json.loads(trace.read_text())


def test_csv_has_the_json_rows_and_the_command(tiny):
    r, _, csv_rows, _ = tiny
    assert len(csv_rows) == len(r["rows"])
    assert [row["mode"] for row in csv_rows] == [row["mode"] for row in r["rows"]]
    assert {row["command"] for row in csv_rows} == {r["meta"]["command"]}
    # As one plain process the script runs too: the notebook's bash block checks it.
