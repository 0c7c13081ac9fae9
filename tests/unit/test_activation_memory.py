"""ddp_course.activation_memory: saved bytes measured with hooks (ddp_course.tools.
saved_tensors) against the per-term prediction (float32 and bfloat16, several shapes, every
policy), Korthikanti's formula and his selective recomputation against the fused kernel,
LayerNorm's statistics, the optimizer state counted exactly, and fit_micro_batch's two
objectives (tests/unit/test_lesson14_step_budget.py measures the step against the budget)."""

import pytest
import torch

from ddp_course import activation_memory as am
from ddp_course import recompute_policies, step_budget
from ddp_course.models import Block, TinyGPT, lm_loss
from ddp_course.tools.saved_tensors import SavedTensorCounter, saved_activation_bytes

D, HEADS = 32, 4


def measured_block(batch, seq, dropout, flash=False, dtype=torch.float32):
    torch.manual_seed(0)
    block = Block(D, HEADS, dropout, flash).to(dtype).train()
    x = torch.randn(batch, seq, D, dtype=dtype, requires_grad=True)
    with SavedTensorCounter(block.parameters()) as saved:
        block(x)
    return saved


@pytest.mark.parametrize("batch,seq", [(1, 8), (2, 16), (3, 32), (4, 64)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_block_bytes_match_the_terms_exactly(batch, seq, dtype):
    e = torch.finfo(dtype).bits // 8
    saved = measured_block(batch, seq, 0.1, dtype=dtype)
    assert saved.activation_bytes == am.block_bytes(batch, seq, D, HEADS, element_bytes=e)


@pytest.mark.parametrize("seq", [16, 24, 64])  # not head_dim (8): [s, s] is unambiguous
def test_block_without_dropout_and_fused_attention(seq):
    plain = measured_block(2, seq, 0.0)
    assert plain.activation_bytes == am.block_bytes(2, seq, D, HEADS, dropout=False)
    fused = measured_block(2, seq, 0.0, flash=True)
    assert fused.activation_bytes == am.block_bytes(2, seq, D, HEADS, dropout=False, flash=True)
    # The fused kernel keeps no [s, s] tensor: its bytes grow linearly with s.
    shapes = [s for s, _, _, kind in fused.saved if kind == "activation"]
    assert not any(shape[-2:] == (seq, seq) for shape in shapes)
    assert any(s[-2:] == (seq, seq) for s, _, _, k in plain.saved if k == "activation")


def test_views_counted_once_and_parameters_apart():
    w = torch.nn.Parameter(torch.randn(8, 8))
    x = torch.randn(4, 8, requires_grad=True)
    with SavedTensorCounter([w]) as once:
        y = x * 2
        (y.view(2, 16) * y.view(2, 16)).sum()  # saves two views of y's storage
        x @ w  # saves x and w
    assert once.activation_bytes == 2 * 4 * 8 * 4  # y and x, once each
    assert once.parameter_bytes == 8 * 8 * 4
    with SavedTensorCounter([w], count_views_once=False) as twice:
        y = x * 2
        (y.view(2, 16) * y.view(2, 16)).sum()
        x @ w
    assert twice.activation_bytes == 3 * 4 * 8 * 4


def test_both_instruments_count_a_block_alike():
    # One rule (MemorySpans): the per-module counter of lesson 13 sees what lesson 14's does.
    torch.manual_seed(0)
    block = Block(D, HEADS, 0.1, flash=False).train()
    x = torch.randn(2, 16, D, requires_grad=True)
    out = {}
    with saved_activation_bytes([block], out):  # hooks do not nest: the inner one sees all
        block(x)
    with SavedTensorCounter(block.parameters()) as saved:
        block(x)
    assert out["bytes"] == saved.activation_bytes > 0
    kinds = [kind for *_, kind in saved.saved if kind != "parameter"]
    assert len(out["shapes"]) == kinds.count("activation") < len(kinds)  # views: once


@pytest.mark.parametrize("seq", [16, 32])
def test_core_attention_drops_the_quadratic_terms_as_the_fused_kernel_does(seq):
    # Korthikanti's selective recomputation: every term but the core's a s^2 b ones and the
    # causal mask, with Q, K, V kept as the checkpoint's inputs. The fused kernel keeps the
    # same plus a float32 log-sum-exp per row: FlashAttention gives the saving for free.
    torch.manual_seed(0)
    block = Block(D, HEADS, 0.0, flash=False).train()
    block.attn.attention_core = recompute_policies.CheckpointedCore(block.attn.attention_core)
    x = torch.randn(2, seq, D, requires_grad=True)
    with SavedTensorCounter(block.parameters()) as core:
        block(x)
    terms = am.block_terms(2, seq, D, HEADS, dropout=False)
    assert core.activation_bytes == sum(t.bytes for t in terms if not t.core) + 3 * 4 * 2 * seq * D
    fused = measured_block(2, seq, 0.0, flash=True).activation_bytes
    assert fused - core.activation_bytes == 4 * HEADS * seq * 2  # the log-sum-exp, no s^2


def test_layernorm_statistics_bytes_on_cuda():
    # bf16 on a CPU keeps bf16 statistics (measured in the test above); CUDA keeps float32.
    cpu = am.block_bytes(2, 16, D, HEADS, element_bytes=2)
    cuda = am.block_bytes(2, 16, D, HEADS, element_bytes=2, stats_bytes=4)
    assert cuda - cpu == 2 * (2 * 2 * 2 * 16)  # two LayerNorms, 2 statistics of 2 more bytes
    mean, rstd = torch.ops.aten.native_layer_norm(
        torch.randn(2, 3, 8, dtype=torch.bfloat16), [8], None, None, 1e-5
    )[1:]
    assert mean.dtype == rstd.dtype == torch.bfloat16  # the CPU kernel's choice


def test_korthikanti_formula_is_the_sum_of_its_terms():
    # 16-bit, 1-byte masks: the paper's 34 sbh + 5 a s^2 b, plus the terms it leaves out.
    for b, s in [(1, 128), (4, 512)]:
        terms = am.block_terms(b, s, 1024, 16, element_bytes=2, mask_bytes=1)
        small = sum(t.bytes for t in terms if "mean" in t.name or t.name == "causal mask")
        assert sum(t.bytes for t in terms) - small == am.korthikanti_block_bytes(s, b, 1024, 16)


CFG = {"d_model": D, "n_heads": HEADS, "n_layers": 3, "seq_len": 32, "dropout": 0.1, "flash": False}


def held_bytes(cfg, batch, seq, policy):
    torch.manual_seed(0)
    model = TinyGPT(**cfg)
    record = recompute_policies.apply_policy(model, policy)
    g = torch.Generator().manual_seed(1)
    x, y = (torch.randint(0, 256, (batch, seq), generator=g) for _ in range(2))
    with SavedTensorCounter(model.parameters()) as saved:
        lm_loss(model(x), y)
    return saved.activation_bytes + record.saved_bytes


@pytest.mark.parametrize("policy", recompute_policies.POLICIES)
@pytest.mark.parametrize("batch,seq", [(2, 16), (3, 32)])
def test_whole_model_per_policy(policy, batch, seq):
    predicted = am.predict_activations(CFG, batch, seq, policy)["held"]
    assert held_bytes(CFG, batch, seq, policy) == predicted


def test_state_bytes_exact_after_an_adamw_step():
    model = TinyGPT(d_model=D, n_heads=HEADS, n_layers=1, seq_len=16)
    opt = torch.optim.AdamW(model.parameters())
    x = torch.randint(0, 256, (2, 16))
    lm_loss(model(x), x).backward()
    opt.step()
    nbytes = sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values())
    grads = sum(p.grad.numel() * p.grad.element_size() for p in model.parameters())
    assert step_budget.state_bytes(model) == {
        "parameters": sum(p.numel() * 4 for p in model.parameters()),
        "gradients": grads,
        "optimizer": nbytes,
    }


def test_fit_micro_batch_by_its_two_objectives():
    budget = 3_000_000
    policy, batch, step = step_budget.fit_micro_batch(CFG, budget, 32)
    assert step.total <= budget
    assert step_budget.predict_step(CFG, batch + 1, 32, policy).total > budget
    largest = {
        p: step_budget.fit_micro_batch(CFG, budget, 32, policies=(p,))[1]
        for p in ("none", "every_other_block", "every_block")
    }
    assert batch == max(largest.values()) == largest[policy] and policy == "every_block"
    # The cheapest policy that fits a target: the first listed whose largest batch reaches it.
    for target in range(1, batch + 1):
        chosen, got, plan = step_budget.fit_micro_batch(CFG, budget, 32, target_batch=target)
        first = next(p for p in largest if largest[p] >= target)
        assert (chosen, got) == (first, target) and plan.total <= budget
    assert step_budget.fit_micro_batch(CFG, budget, 32, target_batch=largest["none"])[0] == "none"
    with pytest.raises(ValueError, match="fit under no policy"):
        step_budget.fit_micro_batch(CFG, budget, 32, target_batch=batch + 1)


def test_bad_input_raises_clearly():
    with pytest.raises(ValueError, match="multiple of n_heads"):
        am.block_terms(2, 8, 30, 4)
    with pytest.raises(ValueError, match="within the s\\^2 causal-mask term"):
        am.block_terms(2, 8, 32, 4, flash=True, dropout=True)
    with pytest.raises(ValueError, match="policy must be"):
        am.predict_activations(CFG, 2, 8, "sometimes")
    with pytest.raises(ValueError, match="longer than"):
        am.predict_activations(CFG, 2, 64)
    with pytest.raises(ValueError, match="budget"):
        step_budget.fit_micro_batch(CFG, 1000, 32)


@pytest.mark.parametrize("policy", recompute_policies.POLICIES)
def test_saved_bytes_are_whole_storages(policy):
    # What an allocator holds for the saved tensors is their storages, whole: the hooks'
    # count (each storage once, views free) equals the storages' sizes, so on a GPU the
    # allocator after forward differs from it only by its rounding (tests/gpu/).
    cfg = {
        "d_model": D,
        "n_heads": HEADS,
        "n_layers": 2,
        "seq_len": 16,
        "dropout": 0.1,
        "flash": False,
    }
    x = torch.randint(0, 256, (2, 16))
    runs = []
    for hooks in ("counter", "storages"):
        torch.manual_seed(0)
        model = TinyGPT(**cfg)
        recompute_policies.apply_policy(model, policy)
        weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
        storages = {}

        def pack(t, weights=weights, storages=storages):
            if t.untyped_storage().data_ptr() not in weights:
                storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        if hooks == "counter":
            with SavedTensorCounter(model.parameters()) as saved:
                lm_loss(model(x), x)
        else:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                lm_loss(model(x), x)
        runs.append(saved.activation_bytes if hooks == "counter" else sum(storages.values()))
    assert runs[0] == runs[1] > 0
