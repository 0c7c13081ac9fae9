"""Lesson 15's scripts, checked by what they report, as a plain process and on 2 ranks.

15_context_parallel.py: ring attention, Ulysses and the all-gather version equal one
process (float64, float32), bytes sent forward and backward equal the formulas, zig-zag
balances the causal work, the mistakes show (document masks; torch's all_gather: on the
backend the job ran with), PyTorch's context_parallel is refused on CPU (its default
passes K and V by all-gather), ring attention in bfloat16 within one rounding with float32
accumulators, the bfloat16 sweep, and a TinyGPT on the ranks (ring attention and all-gather)
equal to one process, loss and every gradient, with the bytes its attention saves per rank and
three mistakes that only more than one rank shows. 15_moe.py: the expert-parallel layer equals
one process and PyTorch's all_to_all_single_autograd, bytes sent equal the routing's count (its
reduction on ctx.device: test_lesson15_moe_device.py), part 2 reports every step; on 4 ranks:
the dropless and capacity-padded exchanges equal one process and send what their formulas say,
EP x DP (2 x 2) equals one process after 3 SGD steps and its two mistakes do not, and a shared
expert equals one process.

Elsewhere: 2, 3 and 4 ranks with the mistakes broken on purpose in
tests/multiprocess/test_context_parallel.py and
test_expert_parallel.py; 4 ranks under nbval in notebook 15.
"""

import importlib.util
import math

import pytest
import torch.distributed.nn.functional as dist_nn

from ddp_course import context_parallel as cp
from ddp_course.harness import launch

ARGS = [
    "--batch-size",
    "2",
    "--n-heads",
    "2",
    "--t-local",
    "4",
    "--head-dim",
    "4",
    "--chunks",
    "1",
    "4",
]
SHAPE = (2, 2, 4, 4)


def check(r, p):
    assert r["world_size"] == p and r["local_shape"] == list(SHAPE)
    assert len(r["diffs"]) == 24
    for name, d in r["diffs"].items():
        assert max(d.values()) <= (1e-12 if "float64" in name else 1e-5), name
    m = r["mistakes"]
    assert max(m["documents masked"].values()) <= 1e-12
    assert max(m["gather_sequence, batch 2, heads 3"].values()) <= 1e-12
    elems = math.prod(SHAPE)
    assert r["formulas"] == {
        "ring": 2 * (p - 1) * elems * 4,
        "ulysses": 4 * (p - 1) * elems * 4 // p,
        "ring backward": (4 * p - 2) * elems * 4 if p > 1 else 0,  # K, V P-1 times, dK, dV P
        "ulysses backward": 4 * (p - 1) * elems * 4 // p,
    }
    for counts in r["counts"]:
        for phase, name in (("bytes", ""), ("backward_bytes", " backward")):
            assert counts["ring contiguous"][phase] == counts["ring zigzag"][phase]
            assert counts["ring contiguous"][phase] == r["formulas"]["ring" + name]
            assert counts["ulysses"][phase] == r["formulas"]["ulysses" + name]
    theirs = r["torch_context_parallel"]
    assert theirs["default_rotate_method"] in (None, "ALL_GATHER"), theirs  # torch all-gathers
    if r["device"] == "cpu":  # rank 0 alone: the refusal is the CPU kernel's
        assert not theirs["ran"] and theirs["ranks"] == 1
        assert "for_cpu" in theirs["error"]
    assert [row["chunks"] for row in r["bf16_sweep"]] == [1, 4]
    assert all(row["float32"] < 1e-5 for row in r["bf16_sweep"])
    # bfloat16 ring attention: float32 accumulators stay within one bfloat16 rounding of
    # float64 (measured: 2e-6 past it at most), bfloat16 ones do not (3e-3 and more).
    beyond = {acc: max(row["beyond_one_rounding"].values()) for acc, row in r["ring_bf16"].items()}
    assert beyond["float32"] <= 1e-5 and beyond["bfloat16"] > 1e-3, beyond
    check_gpt(r["gpt"], p)


def check_gpt(g, p):
    """TinyGPT on groups of 1..p ranks equals one process; ring's saved bytes fall as 1/P."""
    c = g["config"]
    assert [(row["ranks"], row["attention"]) for row in g["rows"]] == [
        (n, a) for n in (1, 2, 4) if n <= p for a in ("ring", "all-gather")
    ]
    for row in g["rows"]:
        assert row["loss"] <= 1e-12 and row["gradients"] <= 1e-12, row
        b, t, d = c["batch_size"], c["tokens"], c["d_model"]
        shape = (b, c["n_heads"], t // row["ranks"], d // c["n_heads"])
        if row["attention"] == "ring":
            assert row["saved_bytes"] == c["n_layers"] * cp.ring_saved_bytes(shape, 8)
        else:  # every rank keeps K and V of the whole sequence
            assert row["saved_bytes"] >= c["n_layers"] * 2 * b * t * d * 8
    wrong = g["mistakes"]
    if p == 1:  # a group of one cannot tell: its positions, loss and gradients are global
        assert all(max(m.values()) <= 1e-12 for m in wrong.values()), wrong
    else:
        assert wrong["local positions"]["gradients"] > 1e-3
        assert wrong["no gradient reduction"]["gradients"] > 1e-3
        assert wrong["no gradient reduction"]["loss"] <= 1e-12  # the loss alone cannot tell
        assert wrong["local mean loss"]["loss"] > 1  # p times the mean: log(64) (p - 1) more


def check_trap(r):
    """torch's deprecated all_gather: wrong K, V gradients on gloo with several heads only."""
    m = r["mistakes"]
    assert hasattr(dist_nn, "all_gather"), (
        "torch removed torch.distributed.nn.functional.all_gather: the notebook now skips "
        "its trap; drop this check and tests/workers/context_parallel_check.py's"
    )
    for shape in ("batch 2, heads 3", "batch 1, heads 3", "batch 2, heads 1", "batch 1, heads 1"):
        assert max(m[f"gather_sequence, {shape}"].values()) <= 1e-12, shape
        assert m[f"torch all_gather, {shape}"]["output"] <= 1e-12, shape
    if r["meta"]["backend"] == "gloo":  # receives into buffers laid out like the gradient
        assert m["torch all_gather, batch 2, heads 3"]["dk"] > 0.1
        assert m["torch all_gather, batch 1, heads 3"]["dk"] > 0.1
        assert max(m["torch all_gather, batch 2, heads 1"].values()) <= 1e-12
    else:  # nccl: a reduce-scatter of contiguous copies
        assert max(m["torch all_gather, batch 2, heads 3"].values()) <= 1e-12
    assert max(m["torch all_gather, batch 1, heads 1"].values()) <= 1e-12


def test_context_parallel_as_plain_python(root):
    r = launch.python(
        root / "scripts/15_context_parallel.py", ARGS, results=True, echo=False, timeout_s=120
    ).results
    check(r, 1)
    assert r["ulysses_refused"] is None  # one rank divides any number of heads


@pytest.mark.parametrize("p", [2])
def test_context_parallel_on_two_ranks(root, p):
    r = launch.torchrun(
        root / "scripts/15_context_parallel.py",
        ARGS,
        nproc=p,
        results=True,
        echo=False,
        timeout_s=180,
    ).results
    check(r, p)
    assert max(r["mistakes"]["documents ignored"].values()) > 0.1  # rank 0 alone: k, v grads
    assert max(r["mistakes"]["causal mask per chunk"].values()) > 0.1
    # Documents numbered per rank: here the ids happen to come out as the global ones (rank 1
    # starts inside document 0); the notebook's 4 ranks x 16 tokens show the difference.
    assert max(r["mistakes"]["documents numbered per rank"].values()) <= 1e-12
    check_trap(r)
    visible = [c["ring zigzag"]["visible"] for c in r["counts"]]
    assert len(set(visible)) == 1
    contiguous = [c["ring contiguous"]["visible"] for c in r["counts"]]
    assert contiguous == [10, 26]  # 4(4+1)/2, then 16 + 10
    assert "3 heads are not divisible by 2 ranks" in r["ulysses_refused"]


@pytest.mark.parametrize("run", ["python", "torchrun"])
def test_moe_script_equals_one_process_and_counts_bytes(root, run):
    args = ["--tokens", "8", "--steps", "3"]
    if run == "python":
        job = launch.python(
            root / "scripts/15_moe.py", args, results=True, echo=False, timeout_s=120
        )
    else:  # 4 ranks: expert parallel over all 4, then EP x DP as a 2 x 2 mesh
        job = launch.torchrun(
            root / "scripts/15_moe.py",
            [*args, "--ep-ranks", "2"],
            nproc=4,
            results=True,
            echo=False,
            timeout_s=240,
        )
    r = job.results
    assert r["world_size"] == (1 if run == "python" else 4)
    check_exchanges(r["exchanges"], r["world_size"], d_model=16)
    check_ep_dp(r["ep_dp"], r["world_size"])
    shared = r["shared_expert"]
    assert max(shared["diffs"].values()) <= 1e-12, shared
    # Each rank's own share of the shared expert's gradient is not the whole (one rank: it is).
    assert (shared["shared_gradient_not_summed"] > 1e-3) == (r["world_size"] > 1)
    assert max(r["diffs"].values()) <= 1e-12
    assert max(r["torch_diffs"].values()) <= 1e-12
    assert len(r["per_rank"]) == r["world_size"]
    for p in r["per_rank"]:
        assert p["measured_bytes_to_others"][0] == p["routing_bytes_to_others"]
    assert {t["aux_weight"] for t in r["training"]} == {0.0, 0.1}
    for t in r["training"]:  # per step: tokens per expert (all ranks), mean router probability
        assert len(t["routed_per_step"]) == len(t["mean_prob_per_step"]) == 3
        assert all(sum(c) == 8 * 32 * r["world_size"] for c in t["routed_per_step"])
        assert all(abs(sum(q) - 1) < 1e-5 for q in t["mean_prob_per_step"])


def check_exchanges(e, n, d_model):
    """Dropless and padded exchanges equal one process; each sends what its formula says."""
    rows = e["rows"]
    for name, row in rows.items():
        assert max(row["diffs"].values()) <= 1e-12, name
        assert len(row["per_rank"]) == n
    assert rows["dropless"]["reference_dropped"] == rows["padded, no drops"]["reference_dropped"]
    assert rows["dropless"]["reference_dropped"] == 0 < rows["padded"]["reference_dropped"]
    for p in rows["dropless"]["per_rank"]:
        assert p["routed"][0] == 8 and p["dropped"] == 0  # every token on expert 0, none lost
        out, back, grad_out, grad_back = p["measured_bytes_to_others"]
        assert out == grad_out == p["routed_bytes_to_others"]
        assert p["all_to_alls"][0] == "torch.int64"  # the counts first: the split sizes
    for name in ("padded, no drops", "padded"):
        for p in rows[name]["per_rank"]:
            assert p["measured_bytes_to_others"] == [p["padded_bytes_to_others"]] * 4
            assert "torch.int64" not in p["all_to_alls"]  # sizes from shapes: no count exchange
    sent = {
        name: sum(p["measured_bytes_to_others"][0] for p in row["per_rank"])
        for name, row in rows.items()
    }
    if n > 1:  # the padded buffers move more than the routed rows
        assert sent["padded, no drops"] > sent["dropless"] > 0
    no_drops = rows["padded, no drops"]["per_rank"][0]
    assert no_drops["capacity"] == 8  # capacity_factor=inf: one slot per token
    assert no_drops["padded_bytes_to_others"] == (n - 1) * (4 // n) * 8 * d_model * 8


def check_ep_dp(g, n):
    """EP x DP after 3 SGD steps equals one process; the two mistakes do not (with DP > 1)."""
    ep_size = 2 if n == 4 else 1
    assert g["mesh"] == [n // ep_size, ep_size] and g["steps"] == 3
    right = g["diffs"]["over the DP group"]
    assert right["router"] <= 1e-12 and right["experts"] <= 1e-12, right
    if n == 4:
        # Rows {0, 1} and {2, 3} hold experts 0-1 and 2-3; columns replicate them.
        assert [(x["ep_rank"], x["dp_rank"], x["experts"]) for x in g["layout"]] == [
            (0, 0, [0, 1]),
            (1, 0, [2, 3]),
            (0, 1, [0, 1]),
            (1, 1, [2, 3]),
        ]
        assert right["all_reduces"] == {"dp": 8, "dp+ep": 1}  # 8 expert tensors, 1 router
        for wrong in ("over the EP group", "not over the DP group"):
            assert g["diffs"][wrong]["experts"] > 1e-3, wrong


def test_the_script_survives_the_removal_of_torchs_differentiable_all_gather(root, monkeypatch):
    # Deprecated by torch: once it is gone the script still imports and skips the trap.
    monkeypatch.delattr(dist_nn, "all_gather")
    spec = importlib.util.spec_from_file_location("cp15", root / "scripts/15_context_parallel.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.torch_all_gather is None
