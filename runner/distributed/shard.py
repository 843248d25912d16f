"""A loaded module split over a process group: tensor or pipeline parallel.

Called by `build_model` (runner/models/build.py) between loading the weights and evaluating
them, so each rank materialises only its share (`distribute(module, architecture)`).

- tensor (`Mode.TENSOR`): mlx-lm's own `Model.shard(group)`: attention heads and MLP columns
  split over the ranks, each block ending in an `all_sum`; every rank runs every layer on
  its share and holds the whole hidden state after each block. Offered where mlx-lm's model
  has `shard`. The heads (query and key/value) must divide by the group's size.
- pipeline (`Mode.PIPELINE`): contiguous layers per rank, mlx-lm's assignment (rank 0 the
  last layers, rank size-1 the first; `split`, layers per rank from rank 0, or an even
  split with the extra layers on the low ranks). Where the text model's forward is one
  plain loop over its layers (`_stageable`: the runner's `LayerKinds` adapters, which
  replace mlx-lm's forward for Qwen2, Qwen3, Qwen3-MoE, Mistral and GPT-OSS, and mlx-lm's
  Llama), the rank keeps its layers (and their kinds), its first layer receives the hidden
  state from rank r+1 and its last sends it to rank r-1: rank 0 ends with the final hidden
  state, which is all the runner needs (only rank 0 unembeds). Where the family keeps
  mlx-lm's own pipelined forward (GLM-4-MoE-Lite), mlx-lm's `pipeline(group, split)` is
  called as it is (it all-gathers the result). The runner's staging goes past mlx-lm's list
  (which has neither Llama, Qwen3, Mistral nor GPT-OSS): the same loop, the same hand-over,
  each family held bit-identical to one process in tests/test_distributed.py.

One forward per evaluation: a rank's receive has no input in its graph, so in one graph
holding two forwards MLX may run the second's receive first and take the first's hidden
state; every forward is evaluated before the next is built (the runner's live state, the
batched rows and the load-time check in runner/models/build.py do so).

Each rank's caches are its own layers' (`make_caches` follows the kept layers), so cache
kinds and bytes differ between ranks in pipeline mode; runner/distributed/leader.py makes
rank 0's decisions hold for every rank's kinds and bytes.

Anything else is a `ModelLoadError` at start-up naming what is supported (`SUPPORTED`).
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import llama
from mlx_lm.models.pipeline import PipelineMixin

from runner.models.decoder import LayerKinds
from runner.sources.source import ModelLoadError

log = logging.getLogger(__name__)


class Mode(enum.Enum):
    TENSOR = "tensor"
    PIPELINE = "pipeline"

    @classmethod
    def parse(cls, text: str) -> Mode:
        for mode in cls:
            if mode.value == text:
                return mode
        raise ValueError(f"unknown distributed mode {text!r}: tensor or pipeline")


def parse_split(text: str) -> list[int] | None:
    """`--pipeline-split 3,1`: layers per rank, rank 0 first; empty: an even split."""
    if not text.strip():
        return None
    try:
        split = [int(part) for part in text.split(",")]
    except ValueError:
        raise ValueError(f"pipeline split {text!r} is not a list of layer counts") from None
    if any(n <= 0 for n in split):
        raise ValueError(f"pipeline split {text!r}: every rank needs at least one layer")
    return split


def even_split(layers: int, size: int) -> list[int]:
    """mlx-lm's even split: the low ranks take the extra layers."""
    base, extra = divmod(layers, size)
    return [base + (1 if r < extra else 0) for r in range(size)]


def owned_layers(split: list[int], rank: int) -> tuple[int, int]:
    """[start, end) of the layers `rank` runs: the layers after those of ranks r+1 .. size-1."""
    start = sum(split[rank + 1 :])
    return start, start + split[rank]


def distributor(
    mode: Mode, group: Any, split: list[int] | None = None
) -> Callable[[nn.Module, str], None]:
    """The `distribute` hook of `build_model` for this rank of `group`."""

    def distribute(module: nn.Module, architecture: str) -> None:
        if mode is Mode.TENSOR:
            shard_tensor(module, architecture, group)
        else:
            shard_pipeline(module, architecture, group, split)

    return distribute


def shard_tensor(module: nn.Module, architecture: str, group: Any) -> None:
    size = group.size()
    if not callable(getattr(module, "shard", None)):
        raise ModelLoadError(_refusal(architecture, Mode.TENSOR))
    for i, layer in enumerate(_layers(module)):
        attention = getattr(layer, "self_attn", None) or getattr(layer, "attention", None)
        for name in ("n_heads", "n_kv_heads", "num_attention_heads", "num_key_value_heads"):
            heads = getattr(attention, name, None)
            if isinstance(heads, int) and heads % size:
                raise ModelLoadError(
                    f"tensor parallel over {size} ranks: layer {i} has {heads} "
                    f"{name.replace('_', ' ')}, which {size} ranks cannot share evenly "
                    "(use --distributed pipeline, or a group size that divides it)"
                )
    try:
        module.shard(group)
    except ValueError as e:  # MLX's: "Cannot shard the output of size N across K devices."
        raise ModelLoadError(f"tensor parallel over {size} ranks: {e}") from None
    log.info("tensor parallel: rank %d of %d holds 1/%d of every layer", group.rank(), size, size)


def shard_pipeline(
    module: nn.Module, architecture: str, group: Any, split: list[int] | None
) -> None:
    size, rank = group.size(), group.rank()
    inner = getattr(module, "model", None)
    if inner is None or not isinstance(getattr(inner, "layers", None), list):
        raise ModelLoadError(_refusal(architecture, Mode.PIPELINE))
    layers = len(inner.layers)
    if split is None:
        split = even_split(layers, size)
    if len(split) != size or sum(split) != layers:
        raise ModelLoadError(
            f"pipeline split {','.join(map(str, split))} does not give {layers} layers to "
            f"{size} ranks (layers per rank, rank 0 first, summing to {layers})"
        )
    start, end = owned_layers(split, rank)
    if _stageable(inner):
        _stage(inner, group, start, end)
    elif isinstance(inner, PipelineMixin) and _forward_is_mlx_lms(inner):
        inner.pipeline(group, split)
    else:
        raise ModelLoadError(_refusal(architecture, Mode.PIPELINE))
    log.info(
        "pipeline parallel: rank %d of %d runs layers [%d, %d) of %d",
        rank,
        size,
        start,
        end,
        layers,
    )


def _layers(module: nn.Module) -> list[Any]:
    inner = getattr(module, "model", None) or getattr(module, "language_model", None)
    layers = getattr(inner, "layers", None)
    if layers is None:
        layers = getattr(getattr(inner, "model", None), "layers", None)
    return list(layers or [])


def _stageable(inner: Any) -> bool:
    """Whether the text model's forward is one plain loop the runner can stage: embed, one
    mask per layer kind from the first cache of that kind, each layer over its cache, the
    final norm. The runner's `LayerKinds` models, and mlx-lm's Llama without windows."""
    if isinstance(inner, LayerKinds):
        return True
    return type(inner).__call__ is llama.LlamaModel.__call__ and inner.swa_idx is None


def _forward_is_mlx_lms(inner: Any) -> bool:
    """Whether the text model's forward is mlx-lm's (which knows its pipeline), not one of
    the runner's adapters."""
    for cls in type(inner).__mro__:
        if "__call__" in vars(cls):
            return cls.__module__.startswith("mlx_lm.")
    return False


def _stage(inner: Any, group: Any, start: int, end: int) -> None:
    """Keep layers [start, end) of a text model (`_stageable`; and their kinds); the first
    receives the hidden state from the rank before it in the pipeline (rank + 1), the last
    sends its output to the rank after it (rank - 1). Rank 0 runs the last layers: its
    output is the model's. Other ranks' outputs are their last layer's (sent on), which the
    runner never reads."""
    rank, size = group.rank(), group.size()
    kept = inner.layers[start:end]
    inner.layers = kept  # the others are never evaluated: their weights stay unread
    if isinstance(inner, LayerKinds):
        inner.kinds = inner.kinds[start:end]
    else:  # mlx-lm's Llama: full attention only, its mask from the first cache
        inner.fa_idx = 0
    receive = rank + 1 if rank < size - 1 else None
    send = rank - 1 if rank > 0 else None
    if receive is not None:
        _wrap(kept[0], group, receive=receive)
    if send is not None:
        _wrap(kept[-1], group, send=send)


def _wrap(layer: nn.Module, group: Any, receive: int | None = None, send: int | None = None):
    """Give one layer instance a subclass whose call receives its input from rank `receive`
    and/or sends its output to rank `send` (its parameters and attributes unchanged)."""
    base = type(layer)
    inner_call = base.__call__
    previous = getattr(layer, "_pipeline", (None, None))
    receive = previous[0] if receive is None else receive
    send = previous[1] if send is None else send

    def __call__(self: Any, x: mx.array, *args: Any, **kwargs: Any) -> mx.array:
        src, dst = self._pipeline
        if src is not None:
            x = mx.distributed.recv_like(x, src, group=group)
        out = inner_call(self, x, *args, **kwargs)
        if dst is not None:
            out = mx.distributed.send(out, dst, group=group)
        return out

    if not getattr(base, "_pipeline_stage", False):  # else one layer both receives and sends
        layer.__class__ = type(
            base.__name__, (base,), {"__call__": __call__, "_pipeline_stage": True}
        )
    object.__setattr__(layer, "_pipeline", (receive, send))


# Registered names (architectures and model types) by mode: the families whose mlx-lm model
# splits that way and whose adapter keeps the modules mlx-lm's `shard` / `pipeline` expect,
# each held equal to one process on tiny models (tests/test_distributed.py; pipeline bit for
# bit, tensor within float32 rounding). Any other is refused at start-up.
_BOTH = (
    "LlamaForCausalLM",
    "llama",
    "Qwen2ForCausalLM",
    "qwen2",
    "Qwen3ForCausalLM",
    "qwen3",
    "Qwen3MoeForCausalLM",
    "qwen3_moe",
    "GptOssForCausalLM",
    "gpt_oss",
    "Glm4MoeLiteForCausalLM",
    "GLM4MoeLite",
    "glm4_moe_lite",
    "MistralForCausalLM",
    "mistral",
)
SUPPORTED: dict[Mode, tuple[str, ...]] = {
    Mode.TENSOR: (*_BOTH, "Ministral3ForCausalLM", "ministral3"),
    Mode.PIPELINE: _BOTH,
}


def _refusal(architecture: str, mode: Mode) -> str:
    names = ", ".join(n for n in SUPPORTED[mode] if n.endswith("ForCausalLM"))
    how = "shards" if mode is Mode.TENSOR else "pipelines"
    return (
        f"--distributed {mode.value}: {architecture} is not supported (mlx-lm {how} only "
        f"some families, and the runner serves those it proves): {names}"
    )


def check_supported(architecture: str, mode: Mode) -> None:
    if architecture not in SUPPORTED[mode]:
        raise ModelLoadError(_refusal(architecture, mode))
