"""Qwen3_5MoeForConditionalGeneration with images vs transformers, on a tiny random model.

The MoE sibling shares dense Qwen3.5's image side (runner/models/qwen3_5_vision.py), so the
dense tests (tests/test_qwen3_5_vision.py) are run here on the MoE model: its tiny text model
is tests/golden's Qwen3.5-MoE (gated-delta and full-attention layers, 4 experts, top-2, a
shared expert), its tower the dense test's, and its goldens
tests/data/golden/qwen3_5_moe_vision.npz (tests/golden/make_qwen3_5_vision_goldens.py, the
same prompts: their token ids are checked against the golden's, so the two tiny configs'
image token ids must agree). Proven here:
- logits equal transformers' (float32, <= 1e-4) with one and with two images and for text,
  one-shot and in chunks that cut inside the images; without the position layout or with
  other pixels they would not;
- greedy generation after an image equals transformers' token for token;
- through the runner (prefill chunks of 5): the same image again restores past its
  expansion with the cold logits, other bytes diverge at it; rows sharing an image are
  batched over it and equal the in-process forward; a completion; and over HTTP
  (/v1/completions and /v1/score) the in-process numbers;
- it loads from an Ollama store with the same logits.
`-m reference` recomputes the goldens live and compares the layout with transformers'
`get_rope_index`.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import tests.test_qwen3_5_vision as dense
from runner.models import ImageModel, build_model
from runner.models.qwen3_5_moe import Qwen3_5MoeMultimodal
from runner.models.qwen3_5_vision import Qwen3_5ImageModel, Qwen3_5Multimodal, VisionModel
from runner.sources.loader import load_local_dir
from tests.golden.make_qwen3_5_vision_goldens import FAMILIES, MOE_ARCH, write_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model(tmp_path_factory.mktemp("qwen3_5_moe-vision"), MOE_ARCH)


@pytest.fixture(scope="module")
def model(model_dir: Path) -> Qwen3_5MoeMultimodal:
    loaded = build_model(load_local_dir(model_dir))
    assert isinstance(loaded, Qwen3_5MoeMultimodal) and isinstance(loaded, ImageModel)
    return loaded


@pytest.fixture(scope="module")
def golden() -> dict[str, np.ndarray]:
    with np.load(FAMILIES[MOE_ARCH].golden) as data:
        return dict(data)


@pytest.fixture(scope="module")
def served(engine, model_dir: Path):
    """The tiny model served with prefill chunks of 5 tokens: chunks end inside images."""
    from runner.backend import Backend
    from runner.service import Runner

    backend = Backend.cpu().replace(prefill_chunk_tokens=5)
    return Runner.load(engine, str(model_dir), backend=backend)


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


@pytest.mark.parametrize("name", ["one", "two", "text"])
def test_logits_equal_transformers_one_shot(model, golden, name: str) -> None:
    dense.test_logits_equal_transformers_one_shot(model, golden, name)


@pytest.mark.parametrize("name", ["one", "two"])
@pytest.mark.parametrize("size", [1, 5, 7])
def test_logits_equal_transformers_in_chunks_that_cut_images(
    model, golden, name: str, size: int
) -> None:
    dense.test_logits_equal_transformers_in_chunks_that_cut_images(model, golden, name, size)


def test_positions_and_pixels_both_matter(model, golden) -> None:
    dense.test_positions_and_pixels_both_matter(model, golden)


def test_greedy_generation_equals_transformers(model, golden) -> None:
    dense.test_greedy_generation_equals_transformers(model, golden)


def test_loads_from_an_ollama_store(model_dir: Path, golden, tmp_path: Path) -> None:
    dense.test_loads_from_an_ollama_store(model_dir, golden, tmp_path)


# --- through the runner: the prefix cache, batched rows, a completion, HTTP ---------------


def test_scores_restore_the_same_image_and_diverge_at_other_bytes(served, engine) -> None:
    dense.test_scores_restore_the_same_image_and_diverge_at_other_bytes(served, engine)


def test_rows_sharing_an_image_are_batched_over_it_and_equal_rows_alone(
    served, engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    dense.test_rows_sharing_an_image_are_batched_over_it_and_equal_rows_alone(
        served, engine, monkeypatch
    )


def test_greedy_completion_after_an_image_equals_the_forward_and_restores_it(
    served, engine
) -> None:
    dense.test_greedy_completion_after_an_image_equals_the_forward_and_restores_it(served, engine)


async def test_over_http_a_completion_and_scores_give_the_in_process_numbers(
    served, engine, make_client
) -> None:
    await dense.test_over_http_a_completion_and_scores_give_the_in_process_numbers(
        served, engine, make_client
    )


# --- reference tier: live transformers ----------------------------------------------------


@pytest.mark.reference
@pytest.mark.usefixtures("reference_libraries")
class TestReference:
    def test_live_goldens_match(self, model_dir: Path, golden) -> None:
        dense.TestReference().test_live_goldens_match(model_dir, golden)

    def test_layout_equals_get_rope_index(self, model, model_dir: Path) -> None:
        dense.TestReference().test_layout_equals_get_rope_index(model, model_dir)
