"""ddp_course.activation_checkpoint: both from-scratch checkpoints (reentrant, and
non-reentrant from saved-tensor hooks) bit-equal to torch.utils.checkpoint and to no
checkpointing with dropout on and under CPU bfloat16 autocast, the RNG bug, each
policy's gradients, and what op-level SAC, the attention core and every Linear
recompute."""

import warnings

import pytest
import torch

from ddp_course import activation_checkpoint as ac
from ddp_course import recompute_policies
from ddp_course.models import Block, TinyGPT, lm_loss
from ddp_course.tools.op_counts import OpCounter
from ddp_course.tools.saved_tensors import SavedTensorCounter


def block_grads(run, seed=5, dropout=0.2, autocast=False):
    torch.manual_seed(0)
    block = Block(32, 4, dropout=dropout, flash=False).train()
    x = torch.randn(2, 16, 32, requires_grad=True)
    torch.manual_seed(seed)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        y = run(block, x)
    y.float().square().sum().backward()
    return [x.grad] + [p.grad for p in block.parameters()]


def torch_checkpoint(m, x):
    return torch.utils.checkpoint.checkpoint(m, x, use_reentrant=False)


def bit_equal(a, b):
    for u, v in zip(a, b, strict=True):
        torch.testing.assert_close(u, v, rtol=0, atol=0)


def test_ours_equals_torch_and_no_checkpoint_bit_for_bit():
    plain = block_grads(lambda m, x: m(x))
    ours = block_grads(lambda m, x: ac.checkpoint(m, x))
    theirs = block_grads(lambda m, x: torch.utils.checkpoint.checkpoint(m, x, use_reentrant=False))
    bit_equal(ours, plain)
    bit_equal(ours, theirs)


def test_the_hooks_form_equals_torch_non_reentrant_bit_for_bit():
    plain = block_grads(lambda m, x: m(x))
    hooks = block_grads(lambda m, x: ac.checkpoint_with_hooks(m, x))
    bit_equal(hooks, block_grads(torch_checkpoint))
    bit_equal(hooks, plain)


@pytest.mark.parametrize("form", [ac.checkpoint, ac.checkpoint_with_hooks])
def test_recompute_under_autocast_replays_it(form):
    # Without the autocast state the rerun computes in float32: gradients off by ~0.1.
    plain = block_grads(lambda m, x: m(x), dropout=0.0, autocast=True)
    theirs = block_grads(torch_checkpoint, dropout=0.0, autocast=True)
    ours = block_grads(lambda m, x: form(m, x), dropout=0.0, autocast=True)
    bit_equal(theirs, plain)
    bit_equal(ours, plain)


@pytest.mark.parametrize("form", [ac.checkpoint, ac.checkpoint_with_hooks])
def test_recompute_without_the_rng_state_gives_other_gradients(form):
    plain = block_grads(lambda m, x: m(x))
    wrong = block_grads(lambda m, x: form(m, x, restore_rng=False))
    assert any(not torch.equal(a, b) for a, b in zip(plain, wrong))


@pytest.mark.parametrize("form", [ac.checkpoint, ac.checkpoint_with_hooks])
def test_the_random_stream_continues_as_without_recomputation(form):
    def after(run):
        block_grads(run)
        return torch.rand(4)

    torch.testing.assert_close(
        after(lambda m, x: m(x)), after(lambda m, x: form(m, x)), rtol=0, atol=0
    )


def test_the_hooks_form_keeps_handles_and_checks_the_rerun():
    torch.manual_seed(0)
    block = Block(32, 4, flash=False)
    x = torch.randn(2, 16, 32, requires_grad=True)
    packed = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(t) or t, lambda t: t):
        y = ac.checkpoint_with_hooks(block, x)
    assert packed == []  # the region's saved tensors went to its own hooks, as handles
    calls = []

    def changes(t):  # saves one tensor fewer the second time: not deterministic
        calls.append(1)
        return block(t) if len(calls) == 1 else block.ln1(t).detach() + t

    y = ac.checkpoint_with_hooks(changes, x)
    with pytest.raises(RuntimeError, match="does not run the same way twice"):
        y.sum().backward()


CFG = {"d_model": 32, "n_heads": 4, "n_layers": 3, "seq_len": 16, "dropout": 0.1, "flash": False}


def model_step(policy, impl="ours"):
    torch.manual_seed(0)
    model = TinyGPT(**CFG)
    record = recompute_policies.apply_policy(model, policy, impl)
    g = torch.Generator().manual_seed(1)
    x, y = (torch.randint(0, 256, (2, 16), generator=g) for _ in range(2))
    torch.manual_seed(3)
    loss = lm_loss(model(x), y)
    with OpCounter() as ops:
        loss.backward()
    return [p.grad for p in model.parameters()], ops.counts, record


@pytest.mark.parametrize("policy", recompute_policies.POLICIES[1:])
@pytest.mark.parametrize("impl", recompute_policies.IMPLS)
def test_every_policy_gives_the_gradients_of_none(policy, impl):
    plain, _, _ = model_step("none")
    grads, _, _ = model_step(policy, impl)
    bit_equal(grads, plain)


def test_op_sac_saves_matmuls_and_recomputes_the_rest():
    _, plain_ops, _ = model_step("none")
    _, block_ops, _ = model_step("every_block")
    _, ops, record = model_step("op_sac")
    # Element-wise work runs again in backward, as under whole-block checkpointing...
    assert plain_ops.get("aten.gelu.default", 0) == 0
    assert ops.get("aten.gelu.default", 0) == block_ops["aten.gelu.default"] == CFG["n_layers"]
    assert ops.get("aten._softmax.default", 0) == CFG["n_layers"]
    # ...but no matrix product does: backward runs the products of none only.
    for name in ("aten.addmm.default", "aten.bmm.default"):
        assert ops.get(name, 0) == plain_ops.get(name, 0) < block_ops[name], name
    assert ops["aten.mm.default"] == plain_ops["aten.mm.default"]
    # Saved per block: 8 products (q, k, v, QK^T, attention x V, proj, fc1, fc2).
    assert len(record.saved_ops) == 8 * CFG["n_layers"]
    s, b, h, a = 16, 2, 32, 4
    assert record.saved_bytes == CFG["n_layers"] * 4 * (10 * s * b * h + a * s * s * b)
    assert "aten.gelu.default" in record.recompute_ops
    # "selective", its old name, is the same policy.
    _, old_ops, old_record = model_step("selective")
    assert old_ops == ops and old_record.saved_bytes == record.saved_bytes


def test_core_attention_recomputes_the_core_and_every_linear_every_linear():
    n = CFG["n_layers"]
    _, plain_ops, _ = model_step("none")
    _, core_ops, _ = model_step("core_attention")
    # QK^T and AV (two bmm) and the softmax run again in each block; no Linear, no GELU.
    assert core_ops["aten.bmm.default"] == plain_ops["aten.bmm.default"] + 2 * n
    assert core_ops.get("aten._softmax.default", 0) == n
    assert core_ops.get("aten.addmm.default", 0) == plain_ops.get("aten.addmm.default", 0)
    assert core_ops.get("aten.gelu.default", 0) == 0
    # Every Linear (q, k, v, proj, fc1, fc2) runs its forward again, and nothing else does.
    _, linear_ops, _ = model_step("every_linear")
    assert linear_ops["aten.addmm.default"] == plain_ops.get("aten.addmm.default", 0) + 6 * n
    assert linear_ops["aten.bmm.default"] == plain_ops["aten.bmm.default"]
    assert linear_ops.get("aten.gelu.default", 0) == 0


def test_bad_input_raises_clearly():
    block = Block(32, 4)
    with pytest.raises(ValueError, match="requires a gradient"):
        ac.checkpoint(block, torch.randn(1, 4, 32))
    with pytest.raises(ValueError, match="policy must be"):
        recompute_policies.apply_policy(TinyGPT(), "half")
    model = TinyGPT()
    recompute_policies.apply_policy(model, "every_block")
    with pytest.raises(ValueError, match="already wrapped"):
        recompute_policies.apply_policy(model, "every_block")
    with pytest.raises(ValueError, match="impl must be"):
        recompute_policies.CheckpointWrapper(block, "mine")
    with pytest.raises(ValueError, match="impl must be"):
        recompute_policies.apply_policy(TinyGPT(), "every_block", impl="mine")
    core = TinyGPT()
    recompute_policies.apply_policy(core, "core_attention")
    with pytest.raises(ValueError, match="already wrapped"):
        recompute_policies.apply_policy(core, "every_block")


_A, _B = torch.randn(3, 4, 5), torch.randn(3, 5, 6)


@pytest.mark.parametrize(
    ("op", "args"),
    [
        (torch.ops.aten.mm.default, (_A[0], _B[0])),
        (torch.ops.aten.addmm.default, (torch.randn(6), _A[0], _B[0])),
        (torch.ops.aten.bmm.default, (_A, _B)),
        (torch.ops.aten._softmax.default, (_A, -1, False)),
    ],
)
@pytest.mark.parametrize("when", ["after the operation", "before it (torch < 2.12)"])
def test_the_policy_counts_the_bytes_each_saved_operation_returns(op, args, when):
    out = op(*args)
    ctx = type("Ctx", (), {"is_recompute": False})()
    if when == "after the operation":
        ctx.op_output = out
    record = recompute_policies.SelectiveRecord()
    policy = recompute_policies.matmul_policy(record, save=(op,))
    assert policy(ctx, op, *args) == torch.utils.checkpoint.CheckpointPolicy.MUST_SAVE
    assert record.saved_bytes == out.numel() * out.element_size()
    assert record.saved_ops == [str(op)]


def test_selective_checkpointing_warns_of_no_change_to_come():
    # torch 2.15 warns (FutureWarning) that the default of respect_saved_tensors_hooks will
    # change, which would make SavedTensorCounter count every saved tensor twice.
    torch.manual_seed(0)
    block = recompute_policies.CheckpointWrapper(
        Block(32, 4, dropout=0.0, flash=False), "selective"
    )
    x = torch.randn(2, 16, 32, requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        with SavedTensorCounter(block.parameters()) as counter:
            y = block(x)
        y.square().sum().backward()
    assert counter.activation_bytes > 0
