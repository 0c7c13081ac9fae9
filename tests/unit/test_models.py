"""models: shapes, BuggyCNN's two mistakes, pipeline stages."""

import math

import pytest
import torch
from torch import nn

from ddp_course import models


def test_small_cnn_outputs_logits():
    out = models.SmallCNN().eval()(torch.randn(4, 1, 28, 28))
    assert out.shape == (4, 10)
    assert not torch.allclose(out.sum(1), torch.ones(4))  # not probabilities


def test_buggy_cnn_linear_layer_does_not_fit():
    with pytest.raises(RuntimeError, match="cannot be multiplied"):
        models.BuggyCNN()(torch.randn(2, 1, 28, 28))


def test_double_softmax_has_a_loss_floor():
    model = models.BuggyCNN(in_features=None).eval()
    probs = model(torch.randn(2, 1, 28, 28))
    torch.testing.assert_close(probs.sum(1), torch.ones(2))
    perfect = torch.eye(10)
    floor = nn.functional.cross_entropy(perfect, torch.arange(10)).item()
    assert math.isclose(floor, math.log(math.e + 9) - 1, rel_tol=1e-6)


def test_mlp_and_layer_stack_shapes():
    assert models.MLP()(torch.randn(5, 1, 28, 28)).shape == (5, 10)
    stack = models.LayerStack(num_layers=4)
    x = torch.randn(3, 784)
    out = x
    for i in range(3):
        out = stack.stage(i, 3)(out)
    torch.testing.assert_close(out, stack(x))
    with pytest.raises(ValueError):
        stack.stage(3, 3)


def test_resnet18_mnist_takes_one_channel():
    out = models.resnet18_mnist().eval()(torch.randn(2, 1, 28, 28))
    assert out.shape == (2, 10)
