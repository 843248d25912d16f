"""GGUF files made by llama.cpp's real converter load as the checkpoints they came from
(`reference` tier: the converter needs torch and transformers).

Each architecture the runner serves from GGUF, as a tiny checkpoint (tests/gguf_models.py
`tiny_checkpoint`: tests/tiny.py's, with what a GGUF cannot say set to llama.cpp's
assumptions), is converted by llama.cpp's own convert_hf_to_gguf.py (llama-cpp-python
0.3.36's, from `$LLAMA_CPP_SRC` or the bench's cache, bench/llamacpp.py `sdist_cache`;
skipped where neither holds it), to float32 and to Q8_0:

- the float32 file computes transformers' logits on the golden sequences within 1e-4: the
  stored goldens (tests/data/golden/<arch>.npz) where the tiny config is the stored one, else
  transformers on the changed checkpoint, live. This proves the metadata and tensor mapping
  (runner/sources/gguf/architectures.py) against the real converter.
- the Q8_0 file computes what the checkpoint of its stored values computes (1e-4).
- the files tests/gguf_models.py writes for the everyday tier are the converter's: the same
  `{arch}.*` metadata (keys, types, values), the same tensors (names, shapes, and in float32
  the same values);
- `--fuse-qkv` files (one attn_qkv per layer) are the same models as the files without.

The converter runs through a small shim, because the tiny checkpoint's tokenizer is not one
it knows: it recognises a BPE pre-tokenizer by the hash of a test string's tokens, which a
vocabulary trained here never matches, so the shim makes that recognition say "gpt-2" (the
tiny tokenizer splits text with GPT-2's byte-level regex: bench/models.py
`llama_cpp_pre_tokenizer`); and Gemma2's and Phi-3's classes read a SentencePiece
tokenizer.model, which the tiny checkpoint lacks, so the shim gives them the byte-level BPE
vocabulary writer (`_set_vocab_gpt2`) every other class here uses. Nothing else of the
converter is changed.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import gguf
import mlx.core as mx
import numpy as np
import pytest

from bench.llamacpp import CONVERTER, sdist_cache, unpacked_sdist
from runner.models import build_model
from runner.sources.gguf.model import load_gguf
from runner.sources.loader import load_local_dir
from tests.gguf_models import (
    GGUF_ARCHITECTURES,
    GGUF_CANNOT,
    checkpoint_of,
    gguf_metadata,
    gguf_names,
    tiny_checkpoint,
    write_gguf,
)
from tests.golden.make_goldens import golden_sequences, reference_logits
from tests.golden_logits import CHUNK, stored_golden

pytestmark = [pytest.mark.reference, pytest.mark.usefixtures("reference_libraries")]

LLAMA_CPP_PYTHON = "0.3.36"  # the converter whose files are checked
TOLERANCE = 1e-4

SHIM = """
import runpy, sys
src = sys.argv[1]
sys.path.insert(0, src)
from conversion.base import TextModel
from conversion.phi import Phi3MiniModel
# the tiny byte-level BPE: GPT-2's pre-tokenizer, which no hash of llama.cpp's names
TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
# Gemma2's and Phi-3's classes want a SentencePiece tokenizer.model: the tiny BPE instead
TextModel._set_vocab_sentencepiece = lambda self, add_to_gguf=True: self._set_vocab_gpt2()
Phi3MiniModel.set_vocab = TextModel._set_vocab_gpt2
sys.argv = [src + "/convert_hf_to_gguf.py", *sys.argv[2:]]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def converter() -> Path:
    given = os.environ.get("LLAMA_CPP_SRC", "").strip()
    # else the converter unpacked from the sdist scripts/setup downloads, or the bench fetched
    if given:
        src = Path(given)
    else:
        src = unpacked_sdist(LLAMA_CPP_PYTHON) or sdist_cache(LLAMA_CPP_PYTHON)
    if not (src / CONVERTER).is_file():
        pytest.skip(
            f"no llama.cpp converter: set $LLAMA_CPP_SRC, or let scripts/setup download the "
            f"llama-cpp-python {LLAMA_CPP_PYTHON} sdist (or the bench fetch it) into {src.parent}"
        )
    return src


def convert(model_dir: Path, out: Path, outtype: str, *options: str) -> Path:
    """convert_hf_to_gguf.py --outtype `outtype` on `model_dir`, through the shim, with the
    converter's own gguf-py first on the path."""
    src = converter()
    env = dict(os.environ, PYTHONPATH=str(src / "gguf-py"))
    command = [sys.executable, "-c", SHIM, str(src), str(model_dir)]
    command += ["--outtype", outtype, "--outfile", str(out), *options]
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("checkpoints")
    return {arch: tiny_checkpoint(arch, root / arch) for arch in GGUF_ARCHITECTURES}


@pytest.fixture(scope="module")
def converted(
    checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> dict[tuple[str, str], Path]:
    """(arch, outtype) -> the converter's file, made on first use."""
    root = tmp_path_factory.mktemp("converted")
    made: dict[tuple[str, str], Path] = {}

    class Lazy(dict):
        def __missing__(self, key: tuple[str, str]) -> Path:
            arch, outtype = key
            made[key] = convert(checkpoints[arch], root / f"{arch}.{outtype}.gguf", outtype)
            return made[key]

    return Lazy()


def expected_logits(arch: str, checkpoint: Path, vocab: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """transformers' last-position logits on the golden sequences: stored, or (a checkpoint
    changed for the GGUF) live, on sequences of the GGUF's `vocab` (Gemma3's converter drops
    the embedding rows past the tokenizer's vocabulary)."""
    if arch not in GGUF_CANNOT:
        return stored_golden(arch)
    sequences = golden_sequences(vocab)
    return list(zip(sequences, reference_logits(checkpoint, sequences), strict=True))


def last_logits(model, tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """One shot, and in chunks of CHUNK through the same caches."""
    ids = mx.array(tokens, dtype=mx.int32)[None]
    one_shot = model.unembed(model.hidden(ids, model.make_caches())[:, -1])[0]
    caches = model.make_caches()
    for start in range(0, ids.shape[1], CHUNK):
        chunked = model.hidden(ids[:, start : start + CHUNK], caches)[:, -1]
    return np.array(one_shot), np.array(model.unembed(chunked)[0])


@pytest.mark.parametrize("arch", GGUF_ARCHITECTURES)
def test_the_converters_file_computes_transformers_logits(
    checkpoints: dict[str, Path], converted, arch: str
) -> None:
    model = build_model(load_gguf(converted[arch, "f32"]))
    for tokens, expected in expected_logits(arch, checkpoints[arch], model.vocab_size):
        expected = expected[: model.vocab_size]
        for way, got in zip(("one shot", "chunked"), last_logits(model, tokens), strict=True):
            diff = np.abs(got - expected).max()
            assert diff <= TOLERANCE, f"{way}: {diff:.3g} over {len(tokens)} tokens"


@pytest.mark.parametrize("arch", GGUF_ARCHITECTURES)
def test_the_converters_q8_file_computes_its_stored_values(
    checkpoints: dict[str, Path], converted, arch: str, tmp_path: Path
) -> None:
    path = converted[arch, "q8_0"]
    source = load_gguf(path)
    assert source.quantization and all(
        v["bits"] == 8 for v in source.quantization.values() if isinstance(v, dict)
    )
    model = build_model(source)
    stored = build_model(load_local_dir(checkpoint_of(path, checkpoints[arch], tmp_path / "x")))
    for tokens in golden_sequences(model.vocab_size):
        got, want = last_logits(model, tokens)[0], last_logits(stored, tokens)[0]
        assert np.abs(got - want).max() <= TOLERANCE


def _fields(path: Path) -> tuple[str, dict[str, tuple[list[str], object]]]:
    reader = gguf.GGUFReader(str(path))
    arch = str(reader.fields["general.architecture"].contents())
    fields = {
        key[len(arch) + 1 :]: ([gguf.GGUFValueType(t).name for t in f.types], f.contents())
        for key, f in reader.fields.items()
        if key.startswith(f"{arch}.")
    }
    return arch, fields


@pytest.mark.parametrize("arch", GGUF_ARCHITECTURES)
def test_the_files_written_here_are_the_converters(
    checkpoints: dict[str, Path], converted, arch: str, tmp_path: Path
) -> None:
    theirs = converted[arch, "f32"]
    ours = write_gguf(checkpoints[arch], tmp_path / "ours.gguf")
    assert gguf_metadata(checkpoints[arch])[0] == _fields(theirs)[0] == _fields(ours)[0]
    their_fields, our_fields = _fields(theirs)[1], _fields(ours)[1]
    assert sorted(our_fields) == sorted(their_fields)
    for key, (types, value) in their_fields.items():
        our_types, our_value = our_fields[key]
        assert our_types == types, key
        if types == ["FLOAT32"]:
            assert np.float32(our_value) == np.float32(value), key
        else:
            assert our_value == value, key
    their_tensors = {t.name: t for t in gguf.GGUFReader(str(theirs)).tensors}
    our_tensors = {t.name: t for t in gguf.GGUFReader(str(ours)).tensors}
    assert sorted(our_tensors) == sorted(their_tensors)
    for name, t in their_tensors.items():
        mine = our_tensors[name]
        assert list(mine.shape) == list(t.shape), name
        assert mine.tensor_type == t.tensor_type == gguf.GGMLQuantizationType.F32, name
        if name == "rope_freqs.weight":  # numpy's float32 pow, not torch's: the last bit
            np.testing.assert_allclose(mine.data, t.data, rtol=1e-6)
        else:
            assert np.array_equal(mine.data, t.data), name


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Gemma3ForCausalLM", "GptOssForCausalLM"])
def test_the_converters_fused_qkv_file_is_the_same_model(
    checkpoints: dict[str, Path], converted, arch: str, tmp_path: Path
) -> None:
    """--fuse-qkv (Llama's Q and K permuted before they are fused, GPT-OSS's biases fused
    too): the same logits as the file with Q, K and V apart."""
    fused = convert(checkpoints[arch], tmp_path / "fused.gguf", "f32", "--fuse-qkv")
    assert any(".attn_qkv." in n for n in gguf_names(fused))
    model, apart = build_model(load_gguf(fused)), build_model(load_gguf(converted[arch, "f32"]))
    for tokens in golden_sequences(model.vocab_size):
        assert np.array_equal(last_logits(model, tokens)[0], last_logits(apart, tokens)[0])
