"""The model contract and the backend layer: capabilities are dispatched, kernels live only on
the runner's own instances, and a batched path that would score wrongly refuses to load."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models import (
    activations,
    base,
    gemma3_text,
    glm4_moe_lite,
    llama,
    qwen3,
    qwen3_5,
    qwen3_next,
)
from mlx_lm.utils import load_model

from runner.backend import Backend, install
from runner.models import CachedScorer, CandidateUnembedder, Model
from runner.score.scorer import Scorer
from runner.score.validate import Row
from runner.sources.source import ModelLoadError
from tests.tiny import (
    TINY_ARCHITECTURES,
    load_tiny_model,
    prefix_cache,
    score_uncached,
    tiny_config,
    write_tiny_model,
)

# --- nothing in mlx-lm is rebound ------------------------------------------------------------


@pytest.mark.parametrize("arch", TINY_ARCHITECTURES)
def test_loading_leaves_mlx_lm_modules_stock(tmp_path, arch):
    model = load_tiny_model(arch, tmp_path / arch)
    stock_attention = base.scaled_dot_product_attention
    for module in (llama, qwen3, gemma3_text, qwen3_next):
        assert module.scaled_dot_product_attention is stock_attention
    for module in (llama, qwen3, qwen3_next, glm4_moe_lite):
        assert module.swiglu is activations.swiglu
    for cls in (llama.Attention, qwen3.Attention, gemma3_text.Attention, qwen3_5.Attention):
        assert cls.__call__.__globals__["scaled_dot_product_attention"] is stock_attention
    assert gemma3_text.MLP.__call__.__module__ == "mlx_lm.models.gemma3_text"
    # ...while the runner's own instances carry its kernels, as subclasses of mlx-lm's.
    kernel_layers = [m for _, m in model.module.named_modules() if getattr(m, "kernel", None)]
    if type(model).KERNELS.attention:  # GLM's latent attention declares none
        assert any(m.kernel == "attention" for m in kernel_layers)
    # subclasses of mlx-lm's classes, or of a family's own (Cohere2-MoE's attention)
    owners = ("mlx_lm.", "runner.models.")
    assert all(type(m).__mro__[1].__module__.startswith(owners) for m in kernel_layers)


STOCK_SCRIPT = """
import sys, pathlib, mlx.core as mx, numpy as np
from mlx_lm.utils import load_model
model, _ = load_model(pathlib.Path(sys.argv[1]))
np.save(sys.argv[2], np.array(model(mx.array([TOKENS]))[0, -1]))
"""
TOKENS = [5, 17, 42, 99, 23, 8, 61, 7, 19, 33, 71, 12, 3, 4, 5, 6, 7, 8]


def test_a_plain_mlx_lm_model_in_the_same_process_computes_stock_results(tmp_path):
    """mlx-lm's own model, loaded beside ours, runs mlx-lm's classes and gives what it gives
    in a process that never imported the runner."""
    import subprocess
    import sys

    path = write_tiny_model("LlamaForCausalLM", tmp_path / "llama")
    load_tiny_model("LlamaForCausalLM", tmp_path / "ours")
    plain, _ = load_model(path)
    assert all(type(layer.self_attn) is llama.Attention for layer in plain.model.layers)
    assert all(type(layer.mlp) is llama.MLP for layer in plain.model.layers)
    here = np.array(plain(mx.array([TOKENS]))[0, -1])
    script = STOCK_SCRIPT.replace("TOKENS", repr(TOKENS))
    out = tmp_path / "stock.npy"
    subprocess.run([sys.executable, "-c", script, str(path), str(out)], check=True, timeout=120)
    np.testing.assert_array_equal(here, np.load(out))


# --- the batched path is checked at load ----------------------------------------------------


class StockAttention:
    """mlx-lm's own attention in the runner's place: rows batched over a shared prefix then
    attend to their suffixes alone."""

    def __init__(self, backend):
        pass

    def __call__(self, *args, **kwargs):
        return base.scaled_dot_product_attention(*args, **kwargs)


def test_a_broken_batched_attention_install_fails_the_load(tmp_path, monkeypatch):
    """With mlx-lm's own attention on the layers, rows batched over a shared prefix attend to
    their suffixes alone: the load must refuse rather than score wrongly."""
    monkeypatch.setattr(install, "Attention", StockAttention)
    with pytest.raises(ModelLoadError, match="rows batched over a shared prefix differ"):
        load_tiny_model("LlamaForCausalLM", tmp_path / "llama")


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Qwen3ForCausalLM"])
def test_a_quantized_model_checks_mlx_path_on_a_stand_in(tmp_path, monkeypatch, arch):
    """Behind a native step, a quantized model's MLX path is checked on a small float32
    stand-in of its family and config (MLX's CPU quantized_matmul made the check cost seconds
    a billion weights), never on the model's own weights; a broken install still fails the
    load, through the stand-in."""
    from runner.models.decoder import DecoderModel
    from tests.quantized_models import load_quantized_model

    backend = Backend.cpu()
    if backend.native_step_max_tokens is None:
        pytest.skip("no native step without the runner's dispatch library")

    def never(self):
        raise AssertionError("MLX's path ran on the quantized model itself")

    with monkeypatch.context() as patched:
        patched.setattr(DecoderModel, "mlx_only", never)
        model = load_quantized_model(arch, tmp_path / "q", 4, 64, backend=backend)
        assert model.native is not None

    monkeypatch.setattr(install, "Attention", StockAttention)
    with pytest.raises(ModelLoadError, match="rows batched over a shared prefix differ"):
        load_quantized_model(arch, tmp_path / "broken", 4, 64, backend=backend)


def test_a_mixture_of_experts_stand_in_is_small():
    """The stand-in of a Qwen3-MoE of 128 experts, 8 a token, 768 wide, dense layers past
    its own two: 8 experts 64 wide (that of Qwen3-30B-A3B had taken 20 s of its load to
    initialize 2.4 GB of experts), its dense layers those it keeps."""
    from runner.models import build, registry

    config = tiny_config("Qwen3MoeForCausalLM") | {
        "num_local_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768,
        "num_hidden_layers": 48, "mlp_only_layers": [1, 40],
    }  # fmt: skip
    arch, family = registry.resolve_architecture(config)
    stand_in = build._stand_in(family, config, arch, Backend.cpu())
    layers = stand_in.module.model.layers
    assert len(layers) == 2 and not hasattr(layers[1].mlp, "switch_mlp")
    experts = layers[0].mlp.switch_mlp.gate_proj.weight
    assert experts.shape == (8, 64, config["hidden_size"])
    assert layers[0].mlp.top_k == 8


def test_a_family_whose_mlx_lm_class_no_longer_calls_attention_fails_the_load(tmp_path):
    class Moved(nn.Module):
        def __call__(self, x):
            return x

    kernels = install.Kernels(attention=(Moved,))
    with pytest.raises(ModelLoadError, match="no longer calls scaled_dot_product_attention"):
        install.install(nn.Sequential(Moved()), kernels, Backend.cpu())


def test_gpu_policy_installs_attention_only(tmp_path):
    model = load_tiny_model("LlamaForCausalLM", tmp_path / "llama", backend=Backend.gpu())
    kinds = {getattr(m, "kernel", None) for _, m in model.module.named_modules()}
    assert "attention" in kinds and "swiglu" not in kinds
    assert not any(type(m).__name__ == "GemvLinear" for _, m in model.module.named_modules())


# --- capabilities -----------------------------------------------------------------------------


class WithoutCandidateRows:
    """A model offering only the required contract (no `unembed_candidates`)."""

    def __init__(self, inner: Model):
        self.inner = inner
        self.architecture = inner.architecture
        self.context_length = inner.context_length
        self.vocab_size = inner.vocab_size

    def make_caches(self):
        return self.inner.make_caches()

    def hidden(self, tokens, caches):
        return self.inner.hidden(tokens, caches)

    def unembed(self, hidden):
        return self.inner.unembed(hidden)


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Gemma3ForCausalLM"])
def test_a_model_without_candidate_unembedding_scores_through_full_logits(engine, tmp_path, arch):
    model = engine.call(lambda job: load_tiny_model(arch, tmp_path / arch))
    plain = WithoutCandidateRows(model)
    assert isinstance(plain, Model) and not isinstance(plain, CandidateUnembedder)
    assert isinstance(model, CandidateUnembedder) and not isinstance(model, CachedScorer)
    shared = [5, 17, 42, 99, 23, 8, 61, 7, 19, 33]
    rows = [Row([*shared, *tail], [3, 7, 11, 300]) for tail in ([4], [9, 10, 12], [])]
    full = engine.call(lambda job: score_uncached(plain, rows, job.check))
    candidates = engine.call(lambda job: score_uncached(model, rows, job.check))
    for a, b in zip(full.logits, candidates.logits, strict=True):
        assert a == pytest.approx(b, abs=1e-4)
    # ...and through a cache that restores, the same numbers again.
    cache = engine.call(lambda job: prefix_cache(plain, name="plain", keep_hidden=True))
    engine.call(lambda job: Scorer(plain, cache).score(rows, job.check))
    again = engine.call(lambda job: Scorer(plain, cache).score(rows, job.check))
    assert again.cached_tokens == sum(len(r.tokens) for r in rows)
    for a, b in zip(again.logits, full.logits, strict=True):
        assert a == pytest.approx(b, abs=1e-5)
