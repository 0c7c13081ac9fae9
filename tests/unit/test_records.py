"""ddp_course.tools.records: the one results file every script writes."""

import csv
import json
import os

import pytest
import torch

from ddp_course.runtime import DistContext
from ddp_course.tools.records import read_results, run_metadata, write_results


def test_run_metadata_names_machine_versions_load_and_command(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    meta = run_metadata(["python", str(tmp_path / "scripts/x.py"), "--mode", "tiny"])
    assert meta["command"] == "python scripts/x.py --mode tiny"  # relative: no machine paths
    assert meta["torch"] == torch.__version__ and meta["machine"]["cpus"] == os.cpu_count()
    assert meta["load_average_1min"] == pytest.approx(os.getloadavg()[0], abs=2.0)
    assert meta["threads_per_rank"] == torch.get_num_threads()
    assert "world_size" not in meta  # no job given
    json.dumps(meta)  # JSON-ready
    # Under torchrun the launcher's line is recorded, not "python".
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setattr("sys.argv", [str(tmp_path / "scripts/x.py"), "collectives"])
    assert run_metadata()["command"] == "torchrun --nproc_per_node=2 scripts/x.py collectives"
    job = run_metadata(ctx=DistContext(rank=0, world_size=2, backend="gloo"))
    assert (job["world_size"], job["backend"], job["device"]) == (2, "gloo", "cpu")


def test_results_with_rows_round_trip_as_json_and_csv(tmp_path):
    ctx = DistContext()
    rows = [
        {"collective": "all_reduce", "bytes": 4096, "median_s": 1e-3},
        {"collective": "broadcast", "bytes": 8192, "median_s": 2e-3, "iqr_s": 1e-4},
    ]
    args = {"repeats": 3, "out": tmp_path, "caps": (1, 25)}
    path = write_results(ctx, tmp_path / "out/10_x.json", {"fits": {"a": 1}}, rows, args)
    assert path.name == "10_x.json" and path.with_suffix(".csv").exists()
    back = read_results(tmp_path / "out/10_x")
    assert set(back) == {"meta", "fits", "rows"} and back["rows"] == rows
    assert back["meta"]["args"] == {"repeats": 3, "out": str(tmp_path), "caps": [1, 25]}
    assert back["meta"]["world_size"] == 1 and back["meta"]["torch"] == torch.__version__
    with open(path.with_suffix(".csv"), newline="") as f:
        lines = list(csv.DictReader(f))
    assert [float(r["median_s"]) for r in lines] == [1e-3, 2e-3]
    assert lines[0]["iqr_s"] == "" and lines[1]["iqr_s"] == "0.0001"
    assert {r["command"] for r in lines} == {back["meta"]["command"]}


def test_results_without_rows_are_json_only_and_written_by_rank_0(tmp_path):
    path = write_results(DistContext(), tmp_path / "r.json", {"loss": 0.5})
    assert json.loads(path.read_text())["loss"] == 0.5 and not path.with_suffix(".csv").exists()
    other = DistContext(rank=1, world_size=2, backend="gloo")
    assert write_results(other, tmp_path / "s.json", {"loss": 0.5}) is None
    assert not (tmp_path / "s.json").exists()
    assert write_results(DistContext(), None, {"loss": 0.5}) is None


def test_bad_results_are_refused_before_anything_is_written(tmp_path):
    ctx = DistContext()
    with pytest.raises(ValueError, match="flat"):
        write_results(ctx, tmp_path / "y.json", {}, [{"times": [1, 2]}])
    with pytest.raises(ValueError, match="no rows"):
        write_results(ctx, tmp_path / "y.json", {}, [])
    with pytest.raises(ValueError, match="meta"):
        write_results(ctx, tmp_path / "y.json", {"meta": 1})
    assert not (tmp_path / "y.json").exists()
    with pytest.raises(FileNotFoundError, match="benchmarks/README.md"):
        read_results(tmp_path / "missing.json")
