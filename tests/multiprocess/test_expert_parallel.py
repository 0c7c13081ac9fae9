"""Expert-parallel MoE (GShard, Switch Transformer) against one process in float64, on 2 and 4
gloo ranks; all-to-alls counted by the collective log and by CommDebugMode, bytes
against the routing; two mistakes caught; PyTorch's all_to_all_single_autograd equal to ours;
dropless routing (capacity_factor=inf) equal to one process with or without capacity groups.
"""

import worker_jobs

D_MODEL, EXPERTS, TOKENS = 8, 4, 12
ARGS = [
    "--d-model",
    str(D_MODEL),
    "--experts",
    str(EXPERTS),
    "--tokens",
    str(TOKENS),
    "--k",
    "2",
    "--capacity-factor",
    "1.0",
]


job = worker_jobs.worker_fixture("expert_parallel_check.py", ARGS, world_sizes=[2, 4])


def test_expert_parallel_equals_one_process_with_capacity_per_rank(job):
    reports = job["variants"]["as_written"]
    for rank, report in enumerate(reports):
        assert worker_jobs.failed(report) == {}, f"rank {rank}"
    checked = set().union(*(r["fails"] for r in reports))
    # Every expert's four parameters were compared, on the rank that holds it.
    assert {
        f"grad expert {e}.{p}.{w}"
        for e in range(EXPERTS)
        for p in ("fc1", "fc2")
        for w in ("weight", "bias")
    } <= checked
    assert {"output", "input_grad", "router_grad", "aux_loss"} <= checked
    # Capacity mattered: tokens were dropped, and capacity over the whole batch
    # (one group instead of one per rank) would have given another output.
    assert sum(r["dropped"] for r in reports) > 0
    assert any(r["global_capacity_differs"] for r in reports)
    assert all(r["capacity"] == -(-TOKENS * 2 // EXPERTS) for r in reports)


def test_split_sizes_follow_the_routing(job):
    reports = job["variants"]["as_written"]
    n = job["world_size"]
    for r, report in enumerate(reports):
        assert report["splits"]["send"] == report["rows_by_rank"]
        # What rank r receives from q is what q's router sent to r's experts.
        assert report["splits"]["receive"] == [reports[q]["rows_by_rank"][r] for q in range(n)]
        assert sum(report["kept"]) == sum(report["rows_by_rank"])
        assert sum(report["routed"]) == TOKENS * 2


def test_bytes_exchanged_equal_the_routing_count(job):
    reports = job["variants"]["as_written"]
    n, row_bytes = job["world_size"], D_MODEL * 8
    for r, report in enumerate(reports):
        phases = [(c["phase"], c["dtype"]) for c in report["calls"]]
        # Counts, rows out, rows back in forward; the two reverse exchanges in backward.
        assert (
            phases
            == [("forward", "torch.int64")]
            + [("forward", "torch.float64")] * 2
            + [("backward", "torch.float64")] * 2
        )
        assert report["calls"][0]["bytes"] == EXPERTS * 8  # one int64 count per expert
        back = sum(reports[q]["rows_by_rank"][r] for q in range(n) if q != r) * row_bytes
        # Forward: the rows out, the results back. Backward, in reverse: the results'
        # gradients go out the way the rows went, the rows' gradients come back.
        out = report["expected_remote_bytes"]
        assert report["sent_remote_bytes"] == [out, back, out, back]
        assert report["expected_remote_bytes"] == report["remote_rows"] * row_bytes
        assert report["comm"] == {
            "forward": {"c10d.alltoall_base_": 3},
            "backward": {"c10d.alltoall_base_": 2},
        }


def test_rows_not_in_the_order_of_the_splits_are_caught(job):
    for report in job["variants"]["rows_out_of_order"]:
        fails = worker_jobs.failed(report)
        # Same splits, same bytes: counting alone would not see it; the values do.
        assert report["comm"]["forward"] == {"c10d.alltoall_base_": 3}
        assert {"output", "input_grad", "router_grad"} <= set(fails)
        assert any(name.startswith("grad expert") for name in fails)


def test_return_exchange_without_its_backward_is_caught(job):
    for report in job["variants"]["return_without_autograd"]:
        fails = worker_jobs.failed(report)
        assert "output" not in fails  # the forward is right: only gradients show it
        assert report["comm"]["backward"] == {}
        assert "input_grad" in fails
        assert {name for name in fails if name.startswith("grad expert")} == {
            f"grad expert {e}.{p}.{w}"
            for e in _local(job, report)
            for p in ("fc1", "fc2")
            for w in ("weight", "bias")
        }


def _local(job, report):
    n = job["world_size"]
    rank = job["variants"]["return_without_autograd"].index(report)
    per = EXPERTS // n
    return range(rank * per, (rank + 1) * per)


def test_pytorch_all_to_all_single_autograd_equals_ours(job):
    for report in job["variants"]["torch"]:
        assert worker_jobs.failed(report) == {}
        # The counts still go through dist.all_to_all_single; the rows through the
        # functional collective, whose backward is the reverse all-to-all.
        assert report["comm"] == {
            "forward": {"c10d.alltoall_base_": 1, "c10d_functional.all_to_all_single": 2},
            "backward": {"c10d_functional.all_to_all_single": 2},
        }


def test_dropless_expert_parallel_equals_one_process_whatever_the_groups(job):
    # capacity_factor=inf: every assignment kept, so capacity groups no longer matter and
    # the expert-parallel layer equals the one-process layer over the whole batch too.
    for report in job["variants"]["dropless"]:
        assert worker_jobs.failed(report) == {}
        assert report["dropped"] == 0 and report["kept"] == report["routed"]
        assert report["capacity"] == TOKENS
        assert not report["global_capacity_differs"]
