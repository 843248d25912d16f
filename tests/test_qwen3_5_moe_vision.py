"""Qwen3_5MoeForConditionalGeneration: dense Qwen3.5's image side over the MoE text model.

The MoE sibling shares dense Qwen3.5's image side (runner/models/qwen3_5_vision/), so what
that side computes is tested on both models by one test body each, parametrized over the
two architectures (tests/test_qwen3_5_vision.py: logits and greedy generation against
transformers, the position layout, the runner's caches, batched rows, HTTP, the Ollama
store, and the reference tier). Proven here: the adapter is that one implementation (not a
copy), with the MoE text model (tests/golden's Qwen3.5-MoE: gated-delta and full-attention
layers, 4 experts, top-2, a shared expert) under it.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from runner.models import ImageModel, build_model
from runner.models.qwen3_5_moe import Qwen3_5MoeMultimodal
from runner.models.qwen3_5_vision import Qwen3_5ImageModel, Qwen3_5Multimodal, VisionModel
from runner.sources.loader import load_local_dir
from tests.golden.make_qwen3_5_vision_goldens import MOE_ARCH, write_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model(tmp_path_factory.mktemp("qwen3_5_moe-vision"), MOE_ARCH)


@pytest.fixture(scope="module")
def model(model_dir: Path) -> Qwen3_5MoeMultimodal:
    loaded = build_model(load_local_dir(model_dir))
    assert isinstance(loaded, Qwen3_5MoeMultimodal) and isinstance(loaded, ImageModel)
    return loaded


def test_the_image_side_is_dense_qwen3_5s_over_the_moe_text_model(
    model: Qwen3_5MoeMultimodal,
) -> None:
    """One implementation of the image side (not a copy), the MoE text model under it."""
    from mlx_lm.models.switch_layers import SwitchGLU

    assert issubclass(Qwen3_5MoeMultimodal, Qwen3_5ImageModel)
    assert not issubclass(Qwen3_5MoeMultimodal, Qwen3_5Multimodal)
    assert isinstance(model.module.visual, VisionModel)
    mlps = [layer.mlp for layer in model.module.model.layers]
    assert len(mlps) == 3 and all(isinstance(m.switch_mlp, SwitchGLU) for m in mlps)
