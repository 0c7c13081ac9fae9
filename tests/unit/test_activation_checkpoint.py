"""ddp_course.activation_checkpoint: the from-scratch checkpoint bit-equal to
torch.utils.checkpoint and to no checkpointing with dropout on, the RNG bug, each
policy's gradients, and what selective checkpointing saves and recomputes."""

import warnings

import pytest
import torch

from ddp_course import activation_checkpoint as ac
from ddp_course import activation_memory as am
from ddp_course.models import Block, TinyGPT, lm_loss


def block_grads(run, seed=5):
    torch.manual_seed(0)
    block = Block(32, 4, dropout=0.2, flash=False).train()
    x = torch.randn(2, 16, 32, requires_grad=True)
    torch.manual_seed(seed)
    run(block, x).square().sum().backward()
    return [x.grad] + [p.grad for p in block.parameters()]


def bit_equal(a, b):
    for u, v in zip(a, b, strict=True):
        torch.testing.assert_close(u, v, rtol=0, atol=0)


def test_ours_equals_torch_and_no_checkpoint_bit_for_bit():
    plain = block_grads(lambda m, x: m(x))
    ours = block_grads(lambda m, x: ac.checkpoint(m, x))
    theirs = block_grads(lambda m, x: torch.utils.checkpoint.checkpoint(m, x, use_reentrant=False))
    bit_equal(ours, plain)
    bit_equal(ours, theirs)


def test_recompute_without_the_rng_state_gives_other_gradients():
    plain = block_grads(lambda m, x: m(x))
    wrong = block_grads(lambda m, x: ac.checkpoint(m, x, restore_rng=False))
    assert any(not torch.equal(a, b) for a, b in zip(plain, wrong))


def test_the_random_stream_continues_as_without_recomputation():
    def after(run):
        block_grads(run)
        return torch.rand(4)

    torch.testing.assert_close(
        after(lambda m, x: m(x)), after(lambda m, x: ac.checkpoint(m, x)), rtol=0, atol=0
    )


CFG = {"d_model": 32, "n_heads": 4, "n_layers": 3, "seq_len": 16, "dropout": 0.1,
       "flash": False}  # fmt: skip


def model_step(policy, impl="ours"):
    torch.manual_seed(0)
    model = TinyGPT(**CFG)
    record = ac.apply_policy(model, policy, impl)
    g = torch.Generator().manual_seed(1)
    x, y = (torch.randint(0, 256, (2, 16), generator=g) for _ in range(2))
    torch.manual_seed(3)
    loss = lm_loss(model(x), y)
    with ac.OpCounter() as ops:
        loss.backward()
    return [p.grad for p in model.parameters()], ops.counts, record


@pytest.mark.parametrize("policy", am.POLICIES[1:])
@pytest.mark.parametrize("impl", ["ours", "torch"])
def test_every_policy_gives_the_gradients_of_none(policy, impl):
    plain, _, _ = model_step("none")
    grads, _, _ = model_step(policy, impl)
    bit_equal(grads, plain)


def test_selective_saves_matmuls_and_recomputes_the_rest():
    _, plain_ops, _ = model_step("none")
    _, block_ops, _ = model_step("every_block")
    _, ops, record = model_step("selective")
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


def test_bad_input_raises_clearly():
    block = Block(32, 4)
    with pytest.raises(ValueError, match="requires a gradient"):
        ac.checkpoint(block, torch.randn(1, 4, 32))
    with pytest.raises(ValueError, match="policy must be"):
        ac.apply_policy(TinyGPT(), "half")
    model = TinyGPT()
    ac.apply_policy(model, "every_block")
    with pytest.raises(ValueError, match="already wrapped"):
        ac.apply_policy(model, "every_block")
    with pytest.raises(ValueError, match="impl must be"):
        ac.CheckpointWrapper(block, "mine")


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
    record = ac.SelectiveRecord()
    policy = ac.matmul_policy(record, save=(op,))
    assert policy(ctx, op, *args) == torch.utils.checkpoint.CheckpointPolicy.MUST_SAVE
    assert record.saved_bytes == out.numel() * out.element_size()
    assert record.saved_ops == [str(op)]


def test_selective_checkpointing_warns_of_no_change_to_come():
    # torch 2.15 warns (FutureWarning) that the default of respect_saved_tensors_hooks will
    # change, which would make SavedTensorCounter count every saved tensor twice.
    torch.manual_seed(0)
    block = ac.CheckpointWrapper(Block(32, 4, dropout=0.0, flash=False), "selective")
    x = torch.randn(2, 16, 32, requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        with am.SavedTensorCounter(block.parameters()) as counter:
            y = block(x)
        y.square().sum().backward()
    assert counter.activation_bytes > 0
