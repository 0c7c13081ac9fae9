"""Lesson 14's whole-step budget against a real step: ddp_course.step_budget's
predict_step is an upper bound of the memory a forward, backward and AdamW step hold at
their peak (ddp_course.tools.peak_memory: the CPU allocator through the profiler), within
the stated margin, for every policy that fit_micro_batch may choose; StepBudget.check
refuses a bound that is too small or too loose."""

import pytest
import torch

from ddp_course import recompute_policies
from ddp_course import step_budget as sb
from ddp_course.data import lm_batch, shakespeare_bytes
from ddp_course.models import TinyGPT, lm_loss
from ddp_course.tools.peak_memory import measured_step_bytes

CFG = {"d_model": 32, "n_heads": 4, "n_layers": 3, "seq_len": 32, "dropout": 0.1, "flash": False}


def measured(batch, policy, seq=32):
    torch.manual_seed(0)
    model = TinyGPT(**CFG)
    recompute_policies.apply_policy(model, policy)
    opt = torch.optim.AdamW(model.parameters())
    x, y = lm_batch(shakespeare_bytes("train"), batch, seq, torch.Generator().manual_seed(0))

    def step():
        lm_loss(model(x), y).backward()
        opt.step()

    step()  # AdamW's state exists from here on, as in every later step
    model.zero_grad(set_to_none=True)
    return measured_step_bytes(model, opt, step)


@pytest.mark.parametrize("policy", ["none", "every_other_block", "every_block", "core_attention"])
def test_the_budget_is_an_upper_bound_within_its_margin(policy):
    plan = sb.predict_step(CFG, 3, 32, policy)
    got = measured(3, policy)
    ratio = plan.check(got)  # raises outside [got, (1 + margin) got]
    assert 1 <= ratio <= 1 + sb.BUDGET_MARGIN
    # The measurement is of the step, not of the state: it holds more than its state.
    assert plan.parameters + plan.optimizer < got


def test_check_refuses_a_bound_too_small_or_too_loose():
    plan = sb.predict_step(CFG, 3, 32, "none")
    assert plan.check(plan.total) == 1.0
    with pytest.raises(ValueError, match="no upper bound"):
        plan.check(plan.total + 1)
    with pytest.raises(ValueError, match="no upper bound"):
        plan.check(int(plan.total / (1 + sb.BUDGET_MARGIN)) - 1)
