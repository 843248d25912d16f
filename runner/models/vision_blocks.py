"""The blocks the runner's vision towers share, written in `mlx.nn` (mlx-lm has no vision
towers): Qwen3.5's (runner/models/qwen3_5_vision/vision.py) and SigLIP's for Gemma3
(runner/models/gemma3_vision/vision.py).

Each block computes with the same operations in the same order for every tower; where the
towers differ only in what their checkpoints call a block's parts (Qwen3.5's `norm1`,
`attn`, `linear_fc1`; SigLIP's `layer_norm1`, `self_attn`, `fc1`), the tower names them.
- `ACTIVATIONS`, `check_activation`: the MLPs' activations by their config name;
- `PatchProjection`: a convolution whose kernel is its stride, as one product;
- `attention_in_query_blocks`: attention over all of an image's patches (no mask), a
  block of queries at a time;
- `rotate_half`: the rotate-half form of rotary embeddings;
- `VisionMLP`: fc1, the activation, fc2;
- `PreNormBlock`: a pre-norm transformer block (LayerNorm, attention, residual;
  LayerNorm, MLP, residual).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from runner.sources.source import ModelLoadError, show

ACTIVATIONS: dict[str, Callable[[mx.array], mx.array]] = {
    "gelu_pytorch_tanh": nn.gelu_approx,
    "gelu": nn.gelu,
}


def check_activation(v: dict[str, Any]) -> None:
    """Refuse a vision config whose `hidden_act` is not one of `ACTIVATIONS`."""
    if v["hidden_act"] not in ACTIVATIONS:
        raise ModelLoadError(
            f"config.json: vision_config.hidden_act must be one of {', '.join(ACTIVATIONS)}, "
            f"not {show(v['hidden_act'])}"
        )


class PatchProjection(nn.Module):
    """A convolution whose kernel is its stride: each flattened patch times the flattened
    [out, *kernel] weight (kept in the checkpoint's layout), plus the bias. Towers subclass
    it with how their input becomes patches."""

    def __init__(self, hidden: int, kernel: tuple[int, ...]):
        super().__init__()
        self.weight = mx.zeros((hidden, *kernel))
        self.bias = mx.zeros((hidden,))

    def project(self, patches: mx.array) -> mx.array:
        """patches [..., prod(kernel)] -> [..., hidden]."""
        return patches @ self.weight.reshape(self.weight.shape[0], -1).T + self.bias


def attention_in_query_blocks(
    q: mx.array, k: mx.array, v: mx.array, scale: float, block: int
) -> mx.array:
    """Attention of q over k, v (each [B, heads, N, head_dim], no mask), `block` queries at a
    time: a large image's whole score matrix would not fit where MLX composes attention from
    its products (the CPU)."""
    return mx.concatenate(
        [
            mx.fast.scaled_dot_product_attention(q[:, :, i : i + block], k, v, scale=scale)
            for i in range(0, q.shape[2], block)
        ],
        axis=2,
    )


def rotate_half(x: mx.array) -> mx.array:
    """(-second half, first half) of the last axis: the rotate-half form of RoPE."""
    half = x.shape[-1] // 2
    return mx.concatenate([-x[..., half:], x[..., :half]], axis=-1)


class VisionMLP(nn.Module):
    """fc2(activation(fc1(x))), its two products named `fc1` and `fc2` as given."""

    def __init__(
        self,
        hidden: int,
        intermediate: int,
        activation: Callable[[mx.array], mx.array],
        fc1: str = "fc1",
        fc2: str = "fc2",
    ):
        super().__init__()
        self.fc1_name, self.fc2_name = fc1, fc2
        setattr(self, fc1, nn.Linear(hidden, intermediate))
        setattr(self, fc2, nn.Linear(intermediate, hidden))
        self.activation = activation

    def __call__(self, x: mx.array) -> mx.array:
        return self[self.fc2_name](self.activation(self[self.fc1_name](x)))


class PreNormBlock(nn.Module):
    """x + attention(norm1(x), *args), then that + mlp(norm2(of it)): LayerNorms of `dim`
    with `eps`, the parts named as given (`mlp` is every tower's)."""

    def __init__(
        self,
        dim: int,
        eps: float,
        attention: nn.Module,
        mlp: nn.Module,
        *,
        norm1: str = "norm1",
        attn: str = "attn",
        norm2: str = "norm2",
    ):
        super().__init__()
        self.norm1_name, self.attn_name, self.norm2_name = norm1, attn, norm2
        setattr(self, norm1, nn.LayerNorm(dim, eps=eps))
        setattr(self, norm2, nn.LayerNorm(dim, eps=eps))
        setattr(self, attn, attention)
        self.mlp = mlp

    def __call__(self, x: mx.array, *args: Any) -> mx.array:
        x = x + self[self.attn_name](self[self.norm1_name](x), *args)
        return x + self.mlp(self[self.norm2_name](x))
