"""The from-scratch DataParallel equals one device on the whole batch."""

import pytest
import torch
from torch import nn

from ddp_course import data_parallel, runtime
from ddp_course.harness.launch import LaunchError, python
from ddp_course.models import MLP, SmallCNN
from ddp_course.replica_plan import plan_replicas

CPU = torch.device("cpu")


def loss_and_grads(model: nn.Module, x: torch.Tensor, y: torch.Tensor):
    model.zero_grad(set_to_none=True)
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


def batch(n: int = 10, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, 1, 28, 28, generator=gen), torch.randint(10, (n,), generator=gen)


@pytest.mark.parametrize(
    "make, replicas",
    [(MLP, 1), (MLP, 2), (MLP, 3), (MLP, 4), (lambda: SmallCNN(dropout=False), 3)],
    ids=["mlp-1", "mlp-2", "mlp-3", "mlp-4", "cnn-3"],
)
def test_loss_and_gradients_equal_one_device(make, replicas):
    torch.manual_seed(0)
    model = make()
    x, y = batch(10)  # 10 over 3 or 4 replicas: uneven chunks
    ref_loss, ref_grads = loss_and_grads(model, x, y)
    dp = data_parallel.DataParallel(model, num_replicas=replicas)
    loss, grads = loss_and_grads(dp, x, y)
    torch.testing.assert_close(loss, ref_loss)
    for g, ref in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g, ref)
    # The gradients are on the original parameters: a step on them is the step.
    assert all(p.grad is not None for p in dp.module.parameters())


def test_training_steps_equal_one_device():
    torch.manual_seed(0)
    plain = MLP()
    copy = MLP()
    copy.load_state_dict(plain.state_dict())
    dp = data_parallel.DataParallel(copy, num_replicas=3, threads=True)
    opt_plain = torch.optim.SGD(plain.parameters(), lr=0.1)
    opt_dp = torch.optim.SGD(dp.parameters(), lr=0.1)
    for step in range(3):
        x, y = batch(12, seed=step)
        for model, opt in ((plain, opt_plain), (dp, opt_dp)):
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
    for a, b in zip(plain.parameters(), dp.module.parameters(), strict=True):
        torch.testing.assert_close(a, b)


def test_threads_and_sequential_agree():
    torch.manual_seed(0)
    model = MLP()
    x, y = batch(9)
    _, threaded = loss_and_grads(data_parallel.DataParallel(model, 3, threads=True), x, y)
    _, sequential = loss_and_grads(data_parallel.DataParallel(model, 3, threads=False), x, y)
    for a, b in zip(threaded, sequential, strict=True):
        torch.testing.assert_close(a, b)


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(6, 6, bias=False)
        self.head = nn.Linear(6, 6, bias=False)
        self.head.weight = self.embed.weight  # one parameter, used twice

    def forward(self, x):
        return self.head(torch.tanh(self.embed(x)))


def test_tied_weights_stay_tied():
    torch.manual_seed(0)
    model = Tied()
    x, y = torch.randn(8, 6), torch.randint(6, (8,))
    ref_loss, ref_grads = loss_and_grads(model, x, y)
    dp = data_parallel.DataParallel(model, num_replicas=2)
    loss, grads = loss_and_grads(dp, x, y)
    assert len(grads) == 1
    torch.testing.assert_close(loss, ref_loss)
    torch.testing.assert_close(grads[0], ref_grads[0])
    replicas = data_parallel.replicate(model, [CPU, CPU])
    assert all(r.head.weight is r.embed.weight for r in replicas)


def test_the_four_steps():
    model = nn.Linear(4, 3)
    x = torch.arange(40.0).reshape(10, 4)
    chunks = data_parallel.scatter((x, "flag"), {"scale": torch.ones(10)}, [CPU] * 3)
    assert [c[0][0].shape[0] for c in chunks] == [4, 3, 3]
    assert [c[0][1] for c in chunks] == ["flag"] * 3  # non-tensors are copied
    assert [c[1]["scale"].shape[0] for c in chunks] == [4, 3, 3]  # kwargs are split too
    replicas = data_parallel.replicate(model, [CPU] * 3)
    for r in replicas:
        # Copies that remember where they came from, not the parameters themselves.
        assert r.weight is not model.weight and not r.weight.is_leaf
        assert r.weight.grad_fn is not None
        torch.testing.assert_close(r.weight, model.weight)
    assert model.weight.is_leaf and isinstance(model.weight, nn.Parameter)
    outputs = data_parallel.parallel_apply(replicas, [((c[0][0],), {}) for c in chunks])
    out = data_parallel.gather(outputs, CPU)
    torch.testing.assert_close(out, model(x))
    out.sum().backward()
    torch.testing.assert_close(model.weight.grad, torch.ones(3, 10) @ x)


def test_timings_cover_every_step():
    model = MLP()
    dp = data_parallel.DataParallel(model, 2)
    x, y = batch(4)
    nn.functional.cross_entropy(dp(x), y).backward()
    assert set(dp.timings) == {"scatter", "replicate", "parallel_apply", "gather", "reduce"}
    assert all(t >= 0 for t in dp.timings.values())


def test_no_grad_forward_builds_no_graph():
    model = MLP()
    dp = data_parallel.DataParallel(model, 2)
    x, _ = batch(6)
    with torch.no_grad():
        out = dp(x)
        ref = model(x)
    assert out.grad_fn is None
    torch.testing.assert_close(out, ref)


def test_state_dict_has_module_prefix():
    dp = data_parallel.DataParallel(nn.Linear(2, 2), 2)
    assert sorted(dp.state_dict()) == ["module.bias", "module.weight"]


def test_batch_smaller_than_replicas_raises():
    dp = data_parallel.DataParallel(MLP(), num_replicas=4)
    with pytest.raises(ValueError, match="batch of 3 cannot be split over 4 replicas"):
        dp(torch.randn(3, 784))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"num_replicas": 0}, "at least 1"),
        ({"num_replicas": 2, "devices": ["cpu"]}, "num_replicas=2 but 1 devices"),
        ({"devices": []}, "devices is empty"),
        ({"devices": ["meta"]}, "must be on devices"),
    ],
)
def test_bad_construction_raises(kwargs, match):
    with pytest.raises(ValueError, match=match):
        data_parallel.DataParallel(nn.Linear(2, 2), **kwargs)


def test_scatter_and_gather_errors():
    with pytest.raises(ValueError, match="differ in size"):
        data_parallel.scatter((torch.ones(4, 2), torch.ones(5, 2)), None, [CPU, CPU])
    with pytest.raises(ValueError, match="no input tensor"):
        data_parallel.scatter(("text",), None, [CPU, CPU])
    with pytest.raises(ValueError, match="nothing to gather"):
        data_parallel.gather([], CPU)


class FailsOnSmallChunks(nn.Module):
    def forward(self, x):
        if len(x) < 3:
            raise ArithmeticError("chunk too small")
        return x


def test_a_failing_replica_is_named():
    dp = data_parallel.DataParallel(FailsOnSmallChunks(), num_replicas=3)
    with pytest.raises(RuntimeError, match="replica 2 raised ArithmeticError") as info:
        dp(torch.ones(8, 1))  # chunks 3, 3, 2
    assert isinstance(info.value.__cause__, ArithmeticError)


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU machine DataParallel does work")
def test_torch_dataparallel_is_a_pass_through_on_cpu():
    model = MLP()
    dp = nn.DataParallel(model)
    assert dp.device_ids == []
    x, _ = batch(5)
    assert torch.equal(dp(x), model(x))


def test_script_trains_with_threads(root, tmp_path):
    result = python(
        root / "scripts" / "02_train_dp.py",
        [
            "--epochs",
            "1",
            "--max-steps",
            "3",
            "--batch-size",
            "16",
            "--replicas",
            "2",
            "--no-progress",
            "--checkpoint",
            str(tmp_path / "dp.pt"),
        ],
        results=True,
        echo=False,
        timeout_s=120,
    )
    res = result.results
    assert res["impl"].endswith("DataParallel") and len(res["devices"]) == 2
    # The device rule: one GPU per replica, or CPU threads (never two replicas on a GPU).
    plan = plan_replicas("auto", 2, runtime.gpu_count())
    assert res["devices"] == [str(d) for d in plan.devices]
    assert res["device_reason"] == plan.reason
    on_gpu = plan.devices[0].type == "cuda"
    assert res["memory"]["kind"] == (
        "cuda max_memory_allocated" if on_gpu else "process RSS at the end"
    )
    assert list(res["memory"]["bytes"]) == (res["devices"] if on_gpu else ["process"])
    assert all(b > 0 for b in res["memory"]["bytes"].values())
    assert 0.0 <= res["test_accuracy"] <= 1.0
    assert res["history"][0]["samples"] == 3 * 16
    assert len(res["step_wall_s"]) == 2  # the intervals between 3 training forward passes
    if res["impl"] == "ddp_course.data_parallel.DataParallel":
        assert set(res["step_seconds"]) == {
            "scatter",
            "replicate",
            "parallel_apply",
            "gather",
            "reduce",
        }
    # A portable checkpoint: no "module." prefix, loads into a plain model.
    state = torch.load(tmp_path / "dp.pt", weights_only=True)
    assert not any(k.startswith("module.") for k in state["model"])
    SmallCNN().load_state_dict(state["model"])


def test_script_refuses_torch_dataparallel_without_a_gpu_per_replica(root):
    # One replica more than there are GPUs: a clear message, not a CUDA error inside torch.
    replicas = runtime.gpu_count() + 1
    with pytest.raises(LaunchError) as info:
        python(
            root / "scripts" / "02_train_dp.py",
            ["--impl", "torch", "--replicas", str(replicas), "--max-steps", "1", "--no-progress"],
            echo=False,
            timeout_s=120,
        )
    output = "".join(info.value.logs.values())
    assert "--impl torch: torch's nn.DataParallel" in output and "--impl scratch" in output
    assert "Traceback" not in output
