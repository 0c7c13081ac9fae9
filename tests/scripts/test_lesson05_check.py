"""training.check_same_training, the check of lesson 05, on models built by hand."""

import pytest
import torch

from ddp_course.models import MLP
from ddp_course.training import check_same_training, parameter_gap


def _sgd_step(model, scale):
    """One SGD step on a fixed batch, with the gradient multiplied by ``scale``."""
    torch.manual_seed(1)
    x, y = torch.randn(8, 20), torch.randint(0, 5, (8,))
    model.zero_grad()
    (scale * torch.nn.functional.cross_entropy(model(x), y)).backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= 0.5 * p.grad


def _models(*scales):
    torch.manual_seed(0)
    initial = MLP(in_features=20, hidden=16, num_classes=5)
    models = []
    for scale in scales:
        m = MLP(in_features=20, hidden=16, num_classes=5)
        m.load_state_dict(initial.state_dict())
        _sgd_step(m, scale)
        models.append(m)
    return initial, models


def test_equal_steps_pass_and_report_the_gap():
    initial, (a, b) = _models(1.0, 1.0)
    result = check_same_training(a, b, initial, atol=1e-6)
    assert result["gap"] == 0 and result["moved"] == parameter_gap(a, initial) > 1e-4


def test_a_gradient_twice_too_large_fails():
    initial, (a, b) = _models(1.0, 2.0)  # what an all-reduce that sums over 2 ranks does
    with pytest.raises(AssertionError, match="did not take the same steps"):
        check_same_training(a, b, initial, atol=1e-6)


def test_a_tolerance_as_large_as_the_step_is_refused():
    initial, (a, b) = _models(1.0, 2.0)
    with pytest.raises(AssertionError, match="train longer"):
        check_same_training(a, b, initial, atol=1.0)


def test_models_of_different_shapes_are_refused():
    with pytest.raises(ValueError, match="same parameter shapes"):
        parameter_gap(MLP(in_features=20), MLP(in_features=10))
