"""A greedy decode step takes its argmax on the host where the native step's head computed
the logits there (`HostLogits`, runner/models/base.py; runner/generate/pipeline.py): the same
tokens as MLX's argmax of `unembed`, with no MLX evaluation for the draw."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from runner.generate.sampling import Sampler, SamplerOptions
from runner.native import preload
from tests.generators import generate, generator_of, tiny_generator
from tests.quantized_models import write_quantized_model

pytestmark = pytest.mark.skipif(
    not preload.dispatch_active(), reason="needs the runner's dispatch library preloaded"
)

PROMPT = [5, 17, 42, 9, 100, 7, 11, 12, 13, 30]


def counting(model, monkeypatch) -> list[int]:
    """Count the model's host_logits calls that gave logits."""
    calls: list[int] = []
    own = model.host_logits

    def host_logits(hidden):
        out = own(hidden)
        if out is not None:
            calls.append(out.shape[0])
        return out

    monkeypatch.setattr(model, "host_logits", host_logits)
    return calls


# heads the native step computes: half-precision copies, quantized codes (a float32 head is
# MLX's product, on the BLAS: then MLX's argmax, as before)
HEADS = [
    ("LlamaForCausalLM", "float16"),
    ("Qwen3ForCausalLM", "bfloat16"),
    ("LlamaForCausalLM", "q4"),
    ("Qwen3ForCausalLM", "q8"),
]


def generator(path, arch: str, kind: str):
    if kind.startswith("q"):
        return generator_of(write_quantized_model(arch, path, int(kind[1:]), 32, "float16"))
    return tiny_generator(path, arch, kind)


@pytest.mark.parametrize(("arch", "kind"), HEADS)
def test_greedy_decode_takes_the_host_argmax_and_mlx_s_tokens(tmp_path, arch, kind, monkeypatch):
    host = generator(tmp_path / "host", arch, kind)
    calls = counting(host.model, monkeypatch)
    tokens, _ = generate(host, PROMPT, 24, {})
    assert calls == [1] * 24  # the seed's forward and one for every token but the last
    plain = generator(tmp_path / "plain", arch, kind)
    monkeypatch.setattr(plain.model, "host_logits", lambda hidden: None)  # MLX's argmax
    assert generate(plain, PROMPT, 24, {})[0] == tokens


def test_a_float32_head_stays_on_mlx(tmp_path, monkeypatch):
    generator = tiny_generator(tmp_path, "LlamaForCausalLM")
    calls = counting(generator.model, monkeypatch)
    assert len(generate(generator, PROMPT, 4, {})[0]) == 4 and calls == []


@pytest.mark.parametrize(
    "options",
    [
        {"temperature": 0.0, "logprobs": True},
        {"temperature": 0.0, "repeat_penalty": 1.3, "repeat_last_n": 8},
        {"temperature": 0.7, "seed": 3},
    ],
)
def test_other_draws_stay_on_mlx(tmp_path, options, monkeypatch):
    generator = tiny_generator(tmp_path, "LlamaForCausalLM", "float16")
    calls = counting(generator.model, monkeypatch)
    tokens, _ = generate(generator, PROMPT, 6, options)
    assert len(tokens) == 6 and calls == []
    assert not Sampler(SamplerOptions(**options), 64, PROMPT).argmax_alone


def test_host_logits_are_unembed_s_and_none_where_the_family_post_processes(tmp_path):
    model = tiny_generator(tmp_path / "llama", "LlamaForCausalLM", "float16").model
    rows = np.random.default_rng(0).standard_normal((3, model.native.hidden))
    hidden = mx.array(rows, mx.float32)
    host = model.host_logits(hidden)
    assert host is not None and host.shape == (3, model.vocab_size)
    np.testing.assert_array_equal(host, np.array(model.unembed(hidden)))
    capped = tiny_generator(tmp_path / "gemma2", "Gemma2ForCausalLM", "float16").model
    hidden = mx.zeros((1, capped.native.hidden), mx.float32)
    assert capped.native.host_logits(hidden) is not None  # its step has the head
    assert not capped.postprocess_is_identity()  # but soft-caps the logits
    assert capped.host_logits(hidden) is None


def test_numpy_s_argmax_chooses_as_mlx_s():
    """The first of equal maxima, -0.0 and 0.0 equal, NaN the largest: what the pipeline
    relies on when it takes the argmax on the host."""
    for row in ([1, 3, 3, 2], [0.0, -0.0, -1], [-0.0, 0.0], [np.nan, 1, 2], [1, np.nan, 2],
                [-np.inf, -np.inf], [2, np.inf, np.inf, np.nan]):  # fmt: skip
        a = np.array(row, np.float32)
        assert int(np.argmax(a)) == int(mx.argmax(mx.array(a)).item()), row
