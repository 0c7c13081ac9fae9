"""Models used across the lessons.

The image models take MNIST-shaped input ``float32 [batch, 1, 28, 28]`` (or
any flattenable shape for the MLP) and return logits
``float32 [batch, num_classes]``: no softmax, because
``nn.CrossEntropyLoss`` applies ``log_softmax`` itself
(https://pytorch.org/docs/stable/generated/torch.nn.CrossEntropyLoss.html).
:class:`TinyGPT`, the Transformer of lessons 13-15, takes byte tokens
``int64 [batch, seq]`` and returns next-token logits
``[batch, seq, vocab_size]``.
"""

from __future__ import annotations

import contextlib
import math

import torch
from torch import nn
from torch.nn import functional

__all__ = [
    "MLP",
    "Block",
    "BuggyCNN",
    "CausalSelfAttention",
    "FeedForward",
    "LayerStack",
    "SmallCNN",
    "TinyGPT",
    "causal_attention",
    "conv_output_features",
    "lm_loss",
    "resnet18_mnist",
]


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


class FeedForward(nn.Module):
    """The Transformer's feed-forward (MLP) block on one process: ``fc2(act(fc1(x)))``.

    Input ``float32 [*, d_model]``, hidden ``[*, hidden]`` (usually
    4 x d_model), output ``float32 [*, d_model]``. The single-process
    reference that :class:`ddp_course.tensor_parallel.ParallelFeedForward`
    splits, and the module that ``parallelize_module`` splits with the plan
    ``{"fc1": ColwiseParallel(), "fc2": RowwiseParallel()}``.

    Args:
        d_model: input and output features.
        hidden: hidden features.
        activation: an element-wise module (default ``nn.GELU()``, as in
            GPT-2 and Megatron-LM); it must act on each feature alone, or the
            column split would be wrong.
    """

    def __init__(self, d_model: int, hidden: int, activation: nn.Module | None = None):
        super().__init__()
        self.fc1 = nn.Linear(d_model, hidden)
        self.act = nn.GELU() if activation is None else activation
        self.fc2 = nn.Linear(hidden, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


def causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dropout: float,
    flash: bool,
    rng: contextlib.AbstractContextManager | None = None,
) -> torch.Tensor:
    """Causal scaled dot-product attention with dropout on the probabilities:
    ``dropout(softmax(Q K^T / sqrt(head_dim) + causal mask)) V`` (Vaswani et al. 2017).

    The one attention core of the course: :class:`CausalSelfAttention` calls it, and so
    does tensor parallelism's attention on its heads
    (``ddp_course.tensor_parallel.ParallelAttention``).

    Args:
        q, k, v: ``[B, heads, T, head_dim]``, one dtype.
        dropout: the probability of dropping an attention probability (0 in eval).
        flash: ``True`` calls ``torch.nn.functional.scaled_dot_product_attention`` (a fused
            kernel that keeps no ``[T, T]`` matrix for backward); ``False`` writes it out.
        rng: a context manager entered around the random draw (the dropout), e.g. a
            tensor-parallel rank's own generator; ``None`` draws from the default one.

    Returns:
        ``[B, heads, T, head_dim]``, in q's dtype.
    """
    rng = contextlib.nullcontext() if rng is None else rng
    if flash:
        with rng:
            return functional.scaled_dot_product_attention(
                q, k, v, dropout_p=dropout, is_causal=True
            )
    seq = q.shape[-2]
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    mask = torch.ones(seq, seq, dtype=torch.bool, device=q.device).tril()
    probs = scores.masked_fill(~mask, float("-inf")).softmax(-1)
    with rng:
        probs = functional.dropout(probs, dropout)
    return probs @ v


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with separate Q, K, V projections.

    Input and output ``[B, T, d_model]``. Q, K and V are ``[B, heads, T,
    head_dim]``; position t attends to positions 0..t only. The number of
    heads is read from the projections' width (``q.out_features //
    head_dim``), so the same module runs whole or with its heads split over
    tensor-parallel ranks, where each rank's Q, K and V hold ``heads / N``
    heads. Separate projections (rather than one fused ``[3 d, d]`` QKV) make
    a column split give each rank whole heads of all three.

    Args:
        d_model: model width d; a multiple of ``n_heads``.
        n_heads: attention heads a; ``head_dim = d / a``.
        dropout: probability for the attention weights and the output.
        flash: ``True`` calls ``scaled_dot_product_attention`` (a fused kernel
            that keeps no ``[T, T]`` matrix for backward); ``False`` writes
            softmax(QK^T / sqrt(head_dim)) V out, keeping the scores,
            probabilities and dropout mask (Vaswani et al. 2017, eq. 1).
            Both give the same output without dropout.

    Raises:
        ValueError: ``d_model`` is not a multiple of ``n_heads``.
    """

    def __init__(self, d_model: int, n_heads: int, dropout: float = 0.0, flash: bool = True):
        super().__init__()
        if d_model % n_heads:
            raise ValueError(f"d_model={d_model} is not a multiple of n_heads={n_heads}")
        self.head_dim = d_model // n_heads
        self.dropout = dropout
        self.flash = flash
        self.q = nn.Linear(d_model, d_model)
        self.k = nn.Linear(d_model, d_model)
        self.v = nn.Linear(d_model, d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.drop = nn.Dropout(dropout)

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq = x.shape[:2]
        return x.view(batch, seq, -1, self.head_dim).transpose(1, 2)

    def attention_core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """The attention core: ``dropout(softmax(Q K^T / sqrt(head_dim) + causal)) V``.

        Everything between the Q, K, V projections and the output projection,
        the part Korthikanti et al. 2022 (section 5, "selective activation
        recomputation") recompute, because it keeps the ``a s^2 b`` tensors.
        A method of its own so that a checkpointing policy can wrap it alone
        (``ddp_course.recompute_policies``).

        Args:
            q, k, v: ``[B, heads, T, head_dim]``.

        Returns:
            ``[B, heads, T, head_dim]``, in q's dtype.
        """
        p = self.dropout if self.training else 0.0
        return causal_attention(q, k, v, p, self.flash)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self._heads(self.q(x)), self._heads(self.k(x)), self._heads(self.v(x))
        y = self.attention_core(q, k, v)
        batch, seq = x.shape[:2]
        return self.drop(self.proj(y.transpose(1, 2).reshape(batch, seq, -1)))


class Block(nn.Module):
    """A pre-LayerNorm Transformer block (GPT-2): ``x + attn(ln1(x))``, then ``+ mlp(ln2(x))``.

    Input and output ``[B, T, d_model]``. The MLP is :class:`FeedForward`
    with 4 d hidden features and GELU, followed by dropout.

    Args:
        d_model, n_heads, dropout, flash: as for :class:`CausalSelfAttention`.
    """

    def __init__(self, d_model: int, n_heads: int, dropout: float = 0.0, flash: bool = True):
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_heads, dropout, flash)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = FeedForward(d_model, 4 * d_model)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.drop(self.mlp(self.ln2(x)))


class TinyGPT(nn.Module):
    """A decoder-only Transformer small enough to train on a CPU (GPT-2's layout).

    Token and learned position embeddings, ``n_layers`` pre-LayerNorm
    :class:`Block` s, a final LayerNorm and a linear head to the vocabulary
    (not tied to the embedding, so each can be split on its own).
    Input ``int64 [B, T]`` with ``T <= seq_len``; output logits
    ``[B, T, vocab_size]`` in the parameters' dtype. Weights are drawn from
    N(0, 0.02), biases zero, as in GPT-2 (Radford et al. 2019), so two
    models built after the same ``torch.manual_seed`` are equal.

    The defaults (256 byte values, d=64, 4 heads, 2 layers, 64 positions;
    137,000 parameters) train on the bundled Shakespeare bytes in
    seconds on a CPU.

    Args:
        vocab_size: token values V.
        d_model: width d.
        n_heads: attention heads a.
        n_layers: blocks L.
        seq_len: longest input T (the number of position embeddings).
        dropout: dropout after the embeddings, on the attention weights and
            after each residual branch.
        flash: see :class:`CausalSelfAttention`.

    Raises:
        ValueError: ``d_model`` is not a multiple of ``n_heads`` (at
            construction), or an input longer than ``seq_len`` (in forward).
    """

    def __init__(
        self,
        vocab_size: int = 256,
        d_model: int = 64,
        n_heads: int = 4,
        n_layers: int = 2,
        seq_len: int = 64,
        dropout: float = 0.0,
        flash: bool = True,
    ):
        super().__init__()
        self.seq_len = seq_len
        self.tok_emb = nn.Embedding(vocab_size, d_model)
        self.pos_emb = nn.Embedding(seq_len, d_model)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(
            Block(d_model, n_heads, dropout, flash) for _ in range(n_layers)
        )
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size, bias=False)
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """Logits ``[B, T, vocab_size]`` of the tokens ``idx`` (``int64 [B, T]``).

        ``positions`` (``int64 [T]``, default ``0..T-1``) are the tokens' places in
        the sequence, which pick their position embeddings: a context-parallel rank
        holds tokens from the middle of the sequence and passes their global
        positions (``ddp_course.context_parallel.gpt``).

        Raises:
            ValueError: an input longer than ``seq_len``, or a position beyond it.
        """
        seq = idx.shape[1]
        if seq > self.seq_len:
            raise ValueError(f"input of {seq} tokens is longer than seq_len={self.seq_len}")
        if positions is None:
            positions = torch.arange(seq, device=idx.device)
        elif positions.shape != (seq,) or int(positions.max()) >= self.seq_len:
            raise ValueError(
                f"positions must be {seq} values below seq_len={self.seq_len}, "
                f"got shape {tuple(positions.shape)}"
            )
        x = self.drop(self.tok_emb(idx) + self.pos_emb(positions))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))

    @torch.no_grad()
    def generate(
        self,
        idx: torch.Tensor,
        new_tokens: int,
        temperature: float = 1.0,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """Append ``new_tokens`` sampled tokens to ``idx`` (``int64 [B, T]``).

        Each step feeds the last ``seq_len`` tokens and samples from the
        softmax of the last position's logits divided by ``temperature``.

        Returns:
            ``int64 [B, T + new_tokens]``.
        """
        for _ in range(new_tokens):
            logits = self(idx[:, -self.seq_len :])[:, -1] / temperature
            probs = logits.float().softmax(-1)
            idx = torch.cat([idx, torch.multinomial(probs, 1, generator=generator)], dim=1)
        return idx


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over every position of the batch.

    Args:
        logits: ``[B, T, V]``.
        targets: ``int64 [B, T]``.

    Returns:
        A scalar: the sum of the B x T token losses divided by B x T.
    """
    return functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
