"""Models used across the lessons. All take MNIST-shaped input
``float32 [batch, 1, 28, 28]`` (or any flattenable shape for the MLP) and
return logits ``float32 [batch, num_classes]``: no softmax, because
``nn.CrossEntropyLoss`` applies ``log_softmax`` itself
(https://pytorch.org/docs/stable/generated/torch.nn.CrossEntropyLoss.html).
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["MLP", "BuggyCNN", "LayerStack", "SmallCNN", "conv_output_features", "resnet18_mnist"]


def conv_output_features(features: nn.Module, input_shape=(1, 28, 28)) -> int:
    """Number of features a convolutional stack outputs per sample.

    Computed with one dummy forward pass on a ``[1, *input_shape]`` zero
    tensor, so the first linear layer always fits the convolutions.
    """
    with torch.no_grad():
        return features(torch.zeros(1, *input_shape)).flatten(1).shape[1]


def _conv_features() -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(1, 32, kernel_size=3),  # [B, 32, 26, 26]
        nn.ReLU(),
        nn.Conv2d(32, 64, kernel_size=3),  # [B, 64, 24, 24]
        nn.ReLU(),
        nn.MaxPool2d(2),  # [B, 64, 12, 12]
        nn.Dropout(0.25),
    )


class SmallCNN(nn.Module):
    """The course's CNN: two 3x3 convolutions, max-pool, two linear layers.

    Input ``float32 [B, 1, 28, 28]``, output logits ``float32 [B, 10]``.
    About 1.2 M parameters; reaches about 0.97 test accuracy on the bundled
    subset after 5 epochs.
    """

    def __init__(self, num_classes: int = 10, hidden: int = 128, dropout: bool = True):
        super().__init__()
        self.features = _conv_features()
        if not dropout:
            self.features[-1] = nn.Identity()
        # The first linear layer is sized from the convolutions' real
        # output (64 * 12 * 12 = 9216), not written down by hand.
        in_features = conv_output_features(self.features)
        self.classifier = nn.Sequential(
            nn.Flatten(),
            nn.Linear(in_features, hidden),
            nn.ReLU(),
            nn.Dropout(0.5) if dropout else nn.Identity(),
            nn.Linear(hidden, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


class BuggyCNN(nn.Module):
    """A CNN with two mistakes that circulate widely, kept to show them in lesson 01.

    1. Its first linear layer takes ``64 * 13 * 13`` features, but the
       convolutions output ``64 * 12 * 12 = 9216``: the forward pass raises
       ``RuntimeError: mat1 and mat2 shapes cannot be multiplied``.
    2. It ends in ``softmax``, and ``nn.CrossEntropyLoss`` applies
       ``log_softmax`` again: the loss can never go below
       ``log(e + 9) - 1 = 1.4612`` for 10 classes and gradients shrink.

    ``BuggyCNN(in_features=None)`` fixes the first mistake only, so the
    second can be measured on its own.
    """

    def __init__(self, num_classes: int = 10, in_features: int | None = 64 * 13 * 13):
        super().__init__()
        self.features = _conv_features()
        if in_features is None:
            in_features = conv_output_features(self.features)
        self.classifier = nn.Sequential(
            nn.Flatten(),
            nn.Linear(in_features, 128),
            nn.ReLU(),
            nn.Dropout(0.5),
            nn.Linear(128, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.softmax(self.classifier(self.features(x)), dim=1)


class MLP(nn.Module):
    """A multi-layer perceptron: flatten, ``depth`` hidden ReLU layers, logits.

    Input ``float32 [B, *]`` with ``in_features`` elements per sample,
    output ``float32 [B, num_classes]``.
    """

    def __init__(
        self,
        in_features: int = 784,
        hidden: int = 256,
        depth: int = 2,
        num_classes: int = 10,
    ):
        super().__init__()
        layers: list[nn.Module] = [nn.Flatten()]
        width = in_features
        for _ in range(depth):
            layers += [nn.Linear(width, hidden), nn.ReLU()]
            width = hidden
        layers.append(nn.Linear(width, num_classes))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class LayerStack(nn.Sequential):
    """``num_layers`` equal blocks ``Linear(width, width) + ReLU`` between an
    input and an output projection, for splitting across pipeline stages.

    Input ``float32 [B, in_features]``, output ``float32 [B, num_classes]``.
    ``stage(i, p)`` returns the i-th of ``p`` contiguous slices.
    """

    def __init__(self, in_features=784, width=256, num_layers=8, num_classes=10):
        blocks: list[nn.Module] = [nn.Flatten(), nn.Linear(in_features, width), nn.ReLU()]
        for _ in range(num_layers):
            blocks += [nn.Linear(width, width), nn.ReLU()]
        blocks.append(nn.Linear(width, num_classes))
        super().__init__(*blocks)

    def stage(self, index: int, num_stages: int) -> nn.Sequential:
        """The ``index``-th of ``num_stages`` contiguous slices of the layers.

        Raises:
            ValueError: if ``index`` is out of range or there are more stages
                than layers.
        """
        n = len(self)
        if not 0 <= index < num_stages or num_stages > n:
            raise ValueError(f"stage {index} of {num_stages} does not fit {n} layers")
        bounds = [round(i * n / num_stages) for i in range(num_stages + 1)]
        return nn.Sequential(*list(self)[bounds[index] : bounds[index + 1]])


def resnet18_mnist(num_classes: int = 10) -> nn.Module:
    """torchvision's ResNet-18 adapted to one-channel 28x28 digits.

    The 7x7 stride-2 stem and its max-pool would shrink 28x28 to 7x7 before
    the first block, so the stem becomes a 3x3 stride-1 convolution over one
    channel and the max-pool is dropped. Input ``float32 [B, 1, 28, 28]``,
    output ``float32 [B, num_classes]``; about 11 M parameters.
    """
    from torchvision.models import resnet18

    model = resnet18(weights=None, num_classes=num_classes)
    model.conv1 = nn.Conv2d(1, 64, kernel_size=3, stride=1, padding=1, bias=False)
    model.maxpool = nn.Identity()
    return model
