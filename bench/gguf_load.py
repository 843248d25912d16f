"""`python -m bench.gguf_load`: how long a GGUF model takes to load, and what it holds.

Writes a Llama-shaped GGUF of random blocks in llama.cpp's Q4_K_M mix (Q4_K for the attention
and MLP weights, Q6_K for `ffn_down`, `attn_v` and the embedding, F32 norms; the scales made
finite, as llama.cpp's quantizer writes them) for a shape (`--shape 1b`: Llama 3.2 1B's
sizes; `135m`: SmolLM2-135M's; `30b-a3b`: a Qwen3-MoE of Qwen3-30B-A3B's sizes, 128 experts
a layer, its `attn_v` and `ffn_down_exps` Q6_K in the layers llama.cpp's Q4_K_M gives more
bits, the others Q4_K, the head Q6_K; `gpt-oss-20b`: gpt-oss at gpt-oss-20b's widths, its
experts MXFP4 as every gpt-oss GGUF keeps them, its other matrices Q8_0 as llama.cpp's
MXFP4_MOE mix, written by the tests' GGUF writer with its 340-token tokenizer, so the head is
small; `--experts N` for fewer than its 32 experts, 4 a token either way; `--halves`: its
matrices BF16 as Ollama's gpt-oss:20b stores them), then times
`load_gguf` (metadata, tokenizer, every
tensor converted) and `build_model`, and reports the resident size of the built model's
weights (its parameters, and the native step's exact half copies of float32 weights: what
the runner holds once the load's own arrays are gone) against the file's (`--keep PATH`:
the random file written there and kept, for another checkout's `--file`). `--layers N`
writes only the first N layers (the 30B's 48 would take 18.6 GB of
disk). `--file PATH` times an existing GGUF instead (the default model's, a store's blob), or
a model directory. `--forwards` then times the loaded model in process: decode steps (16
greedy tokens after a 64-token prompt, ms a token), a 128-token prompt (median of 3, ms a
prompt token) and scoring's rows (8 rows of 6 tokens batched over a shared 128-token prefix,
the prefix's forward apart: ms for the rows' forward and their last positions' logits, median
of 3), random token ids: what bench/RESULTS.md's "Experts in their blocks" and "Experts in
the step" compare between checkouts. `--llama-cpp` (with `--forwards`, a GGUF, and
llama-cpp-python installed) times the same three on the same file by llama.cpp in this
process: its rows one after another over the kept prefix (it batches no rows over a shared
prefix; bench/llamacpp.py scores that way too).

    python -m bench.gguf_load --shape 1b
    python -m bench.gguf_load --shape 30b-a3b --layers 4 --forwards
    python -m bench.gguf_load --file PATH.gguf
    python -m bench.gguf_load --file PATH.gguf --forwards --llama-cpp
    python -m bench.gguf_load --shape gpt-oss-20b --layers 2 --experts 8 --forwards --llama-cpp
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

SHAPES = {  # hidden, layers, heads, kv heads, intermediate, vocabulary
    "135m": (576, 30, 9, 3, 1536, 49152),
    "1b": (2048, 16, 32, 8, 8192, 128256),
    "30b-a3b": (2048, 48, 32, 4, 6144, 151936),
    "gpt-oss-20b": (2880, 24, 64, 8, 2880, 340),  # (the tests' tokenizer: 340 tokens)
}
# Mixture-of-experts shapes: head dim, experts, experts a token, an expert's intermediate size
EXPERTS = {"30b-a3b": (128, 128, 8, 768)}
Q4_K, Q6_K, F32 = 12, 14, 0


def more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's `use_more_bits`: the layers whose attn_v and ffn_down Q4_K_M stores Q6_K."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


# gpt-oss shapes: head dim, experts, experts a token
GPT_OSS = {"gpt-oss-20b": (64, 32, 4)}


def write_gpt_oss(
    shape: str,
    path: Path,
    cut: int | None = None,
    experts: int | None = None,
    halves: bool = False,
) -> Path:
    """A random gpt-oss GGUF of `shape` (its first `cut` layers, `experts` experts a layer):
    experts MXFP4, matrices Q8_0 (`halves`: BF16, as Ollama's gpt-oss:20b stores them), the
    rest F32, through tests/gguf_models.py's writer (the metadata llama.cpp's converter
    writes; values normal(0, 0.02), norms 1), one tensor in float32 at a time."""
    from tests.gguf_models import T, tiny_checkpoint
    from tests.gguf_models import write_gguf as write_checkpoint

    hidden, layers, heads, kv_heads, inter, vocab = SHAPES[shape]
    head_dim, count, used = GPT_OSS[shape]
    layers = layers if cut is None else min(cut, layers)
    count = count if experts is None else experts
    rng = np.random.default_rng(0)
    shapes: dict[str, tuple[int, ...]] = {
        "output.weight": (vocab, hidden), "token_embd.weight": (vocab, hidden),
        "output_norm.weight": (hidden,),
    }  # fmt: skip
    q, kv = heads * head_dim, kv_heads * head_dim
    for i in range(layers):
        p = f"blk.{i}."
        shapes |= {
            p + "attn_norm.weight": (hidden,), p + "post_attention_norm.weight": (hidden,),
            p + "ffn_gate_inp.weight": (count, hidden), p + "ffn_gate_inp.bias": (count,),
            p + "attn_q.weight": (q, hidden), p + "attn_q.bias": (q,),
            p + "attn_k.weight": (kv, hidden), p + "attn_k.bias": (kv,),
            p + "attn_v.weight": (kv, hidden), p + "attn_v.bias": (kv,),
            p + "attn_output.weight": (hidden, q), p + "attn_output.bias": (hidden,),
            p + "attn_sinks.weight": (heads,),
            p + "ffn_gate_exps.weight": (count, inter, hidden),
            p + "ffn_gate_exps.bias": (count, inter),
            p + "ffn_up_exps.weight": (count, inter, hidden),
            p + "ffn_up_exps.bias": (count, inter),
            p + "ffn_down_exps.weight": (count, hidden, inter),
            p + "ffn_down_exps.bias": (count, hidden),
        }  # fmt: skip

    def value(name: str, dims: tuple[int, ...]) -> np.ndarray:
        if name.endswith("norm.weight"):
            return np.ones(dims, np.float32)
        return rng.normal(0.0, 0.02, dims).astype(np.float32)

    def edit(arch: str, metadata: dict, tensors: Any) -> tuple[str, dict, Any]:
        metadata = dict(metadata) | {
            "block_count": layers, "embedding_length": hidden, "feed_forward_length": inter,
            "attention.head_count": heads, "attention.head_count_kv": kv_heads,
            "expert_count": count, "expert_used_count": used, "attention.key_length": head_dim,
            "attention.value_length": head_dim, "attention.sliding_window": 128,
            "expert_feed_forward_length": inter,
        }  # fmt: skip
        return arch, metadata, ((n, value(n, d)) for n, d in shapes.items())

    def rule(name: str, dims: tuple[int, ...], arch: str) -> Any:
        if len(dims) < 2 or "ffn_gate_inp" in name or not name.endswith(".weight"):
            return T.F32
        return T.MXFP4 if "_exps" in name else T.BF16 if halves else T.Q8_0

    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = tiny_checkpoint("GptOssForCausalLM", Path(tmp) / "hf")  # its metadata
        return write_checkpoint(checkpoint, path, rule, edit=edit)


def write_gguf(shape: str, path: Path, cut: int | None = None) -> Path:
    """A random GGUF of `shape` (its first `cut` layers) in Q4_K_M's mix, with a small
    tokenizer (`gpt2`, byte tokens)."""
    import gguf

    from runner.sources.gguf import quants

    hidden, layers, heads, kv_heads, inter, vocab = SHAPES[shape]
    layers = layers if cut is None else min(cut, layers)
    head_dim = hidden // heads
    moe = EXPERTS.get(shape)
    if moe is not None:
        head_dim = moe[0]
    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(str(path), "qwen3moe" if moe else "llama")
    writer.add_block_count(layers)
    writer.add_context_length(8192)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(inter)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(500000.0)
    if moe is not None:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
        writer.add_expert_count(moe[1])
        writer.add_expert_used_count(moe[2])
        writer.add_expert_feed_forward_length(moe[3])
    tokens = ["a", "b", "ab", *(f"<{i}>" for i in range(3, vocab))]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("llama-bpe")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.NORMAL] * vocab)
    writer.add_token_merges(["a b"])
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(1)

    def blocks(kind: int, rows: int, cols: int, lead: tuple[int, ...] = ()) -> np.ndarray:
        info = quants.TYPES[kind]
        count = int(np.prod(lead, dtype=np.int64)) * rows * cols // info.block_size
        data = rng.integers(0, 256, size=(count, info.type_size), dtype=np.uint8)
        # finite fp16 scales (d, dmin) as a quantizer writes them: exponent below 0x7C00
        for at in (0, 2) if kind == Q4_K else (info.type_size - 2,):
            half = data[:, at : at + 2].view("<u2")
            half &= 0x3BFF  # |d| < 1
        return data.reshape(*lead, rows, cols // info.block_size * info.type_size)

    def add(name: str, kind: int, rows: int, cols: int, lead: tuple[int, ...] = ()) -> None:
        if kind == F32:
            writer.add_tensor(
                name, np.ones(cols, np.float32) if rows == 1 else np.zeros((rows, cols), np.float32)
            )
            return
        writer.add_tensor(
            name,
            blocks(kind, rows, cols, lead),
            raw_dtype=gguf.GGMLQuantizationType(kind),
        )

    add("token_embd.weight", Q4_K if moe else Q6_K, vocab, hidden)
    add("output_norm.weight", F32, 1, hidden)
    if moe:
        add("output.weight", Q6_K, vocab, hidden)
    for i in range(layers):
        p = f"blk.{i}."
        more = Q6_K if moe is None or more_bits(i, layers) else Q4_K
        add(p + "attn_norm.weight", F32, 1, hidden)
        add(p + "ffn_norm.weight", F32, 1, hidden)
        add(p + "attn_q.weight", Q4_K, heads * head_dim, hidden)
        add(p + "attn_k.weight", Q4_K, kv_heads * head_dim, hidden)
        add(p + "attn_v.weight", more, kv_heads * head_dim, hidden)
        add(p + "attn_output.weight", Q4_K, hidden, heads * head_dim)
        if moe is None:
            add(p + "ffn_gate.weight", Q4_K, inter, hidden)
            add(p + "ffn_up.weight", Q4_K, inter, hidden)
            add(p + "ffn_down.weight", Q6_K, hidden, inter)
            continue
        _, experts, _, expert_inter = moe
        add(p + "attn_q_norm.weight", F32, 1, head_dim)
        add(p + "attn_k_norm.weight", F32, 1, head_dim)
        writer.add_tensor(
            p + "ffn_gate_inp.weight",
            rng.normal(0, 0.02, (experts, hidden)).astype(np.float32),
        )
        add(p + "ffn_gate_exps.weight", Q4_K, expert_inter, hidden, (experts,))
        add(p + "ffn_up_exps.weight", Q4_K, expert_inter, hidden, (experts,))
        add(p + "ffn_down_exps.weight", more, hidden, expert_inter, (experts,))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def measure(
    path: Path,
    forwards: bool = False,
    steps: int = 16,
    prompt: int = 128,
    llama_cpp: bool = False,
) -> None:
    """Load and build the model at `path` (a GGUF, or a model directory) and report; with
    `forwards`, time `steps` decode steps, a `prompt`-token prompt and rows over a prefix
    (and with `llama_cpp`, the same by llama.cpp: `time_llama_cpp`)."""
    from mlx.utils import tree_flatten

    from runner.models import build_model
    from runner.sources.gguf.model import load_gguf
    from runner.sources.loader import load_local_dir

    started = time.perf_counter()
    source = load_local_dir(path) if path.is_dir() else load_gguf(path)
    loaded = time.perf_counter()
    model = build_model(source)
    built = time.perf_counter()
    del source  # what the model holds: its parameters (kept blocks, or their conversions)
    resident = sum(int(w.nbytes) for _, w in tree_flatten(model.module.parameters()))
    # and the native step's exact half copies of float32 weights, which it keeps beside them
    copies = sum(int(c.nbytes) for c in getattr(model.native, "half_copies", ()))
    resident += copies
    files = [path] if path.is_file() else [f for f in path.iterdir() if f.is_file()]
    size = sum(f.stat().st_size for f in files)
    print(f"{path.name}: {size / 1e6:.1f} MB file")
    print(f"  load_gguf {loaded - started:.2f} s, build_model {built - loaded:.2f} s")
    of_it = f", {copies / 1e6:.1f} MB of it the step's half copies" if copies else ""
    print(f"  resident {resident / 1e6:.1f} MB ({resident / size:.2f}x the file{of_it})")
    if forwards:
        decode, prefill = time_forwards(model, steps, prompt)
        print(f"  decode {decode:.2f} ms a token ({steps} steps after a 64-token prompt)")
        print(f"  prompt {prefill:.2f} ms a token ({prompt} tokens, median of 3)")
        rows = time_rows(model, prompt)
        print(f"  rows {rows:.2f} ms (8 rows of 6 tokens over a {prompt}-token prefix)")
    del model
    if forwards and llama_cpp:
        from bench.base import Skipped

        try:
            measured = time_llama_cpp(path, steps, prompt)
        except Skipped as e:
            print(f"  llama.cpp skipped: {e}")
            return
        figures = zip(("decode", "prompt", "rows"), measured, (decode, prefill, rows), strict=True)
        for name, theirs, ours in figures:
            print(f"  llama.cpp {name} {theirs:.2f} ms: ours {theirs / ours:.2f}x its speed")


def time_forwards(model: object, steps: int, prompt: int) -> tuple[float, float]:
    """(ms a decode token, ms a prompt token) of `model` in process: `steps` greedy decode
    steps after a 64-token prompt, and the median of 3 `prompt`-token prompts."""
    import contextlib
    import statistics

    import mlx.core as mx

    from runner.models.base import DecodeSteps, HostLogits

    m: Any = model
    rng = np.random.default_rng(0)
    top = max(4, min(int(m.vocab_size), 4000))

    def ids(n: int) -> mx.array:
        return mx.array([rng.integers(3, top, n).tolist()], dtype=mx.int32)

    caches = m.make_caches()
    mx.eval(m.hidden(ids(64), caches))
    token = 5
    started = 0.0
    # as the generation pipeline decodes (runner/generate/pipeline.py): inside the model's
    # decode steps (limbs where the library has them), a greedy token from the host's logits
    # where the model computes them there; plain forwards of one row are not what it runs
    steps_of = m.decode_steps if isinstance(m, DecodeSteps) else contextlib.nullcontext
    host = m if isinstance(m, HostLogits) else None
    for step in range(steps + 2):  # two untimed
        if step == 2:
            started = time.perf_counter()
        with steps_of():
            hidden = m.hidden(mx.array([[token]], dtype=mx.int32), caches)
            logits = host.host_logits(hidden[:, -1:]) if host is not None else None
            if logits is not None:
                token = int(np.argmax(logits[0]))
            else:
                token = int(mx.argmax(m.unembed(hidden[:, -1:])).item())
    decode = (time.perf_counter() - started) / steps * 1e3
    times = []
    for _ in range(4):  # the first untimed
        tokens, caches = ids(prompt), m.make_caches()
        begun = time.perf_counter()
        hidden = m.hidden(tokens, caches)
        mx.eval(m.unembed(hidden[:, -1:]))
        times.append((time.perf_counter() - begun) / prompt * 1e3)
    return decode, statistics.median(times[1:])


def time_rows(model: object, prefix: int, rows: int = 8, tokens: int = 6) -> float:
    """ms for `rows` rows of `tokens` tokens batched over a shared `prefix`-token prefix, as
    /v1/score runs a request's rows (runner/cache/batch.py): their forward and their last
    positions' logits, the prefix's forward untimed; the median of 3 after one untimed."""
    import statistics

    import mlx.core as mx

    from runner.cache.batch import broadcast, forward_suffixes
    from runner.cache.kinds import kind_of

    m: Any = model
    rng = np.random.default_rng(1)
    top = max(4, min(int(m.vocab_size), 4000))
    times = []
    for _ in range(4):
        caches = m.make_caches()
        mx.eval(m.hidden(mx.array([rng.integers(3, top, prefix).tolist()], dtype=mx.int32), caches))
        suffixes = [rng.integers(3, top, tokens).tolist() for _ in range(rows)]
        begun = time.perf_counter()
        batch = broadcast([kind_of(c) for c in caches], caches, rows)
        hidden = forward_suffixes(m, batch, suffixes)
        mx.eval(m.unembed(hidden[:, -1:]))
        times.append((time.perf_counter() - begun) * 1e3)
    return statistics.median(times[1:])


def time_llama_cpp(
    path: Path, steps: int, prompt: int, rows: int = 8, tokens: int = 6
) -> tuple[float, float, float]:
    """`time_forwards`' and `time_rows`' figures by llama.cpp (llama-cpp-python in this
    process, every core, as bench/llamacpp.py runs it) on the GGUF at `path`, the same token
    ids: ms a decode token, ms a prompt token, and ms for the rows, each evaluated after the
    prefix's kept KV (llama.cpp batches no rows over a shared prefix), its last logits read."""
    import statistics

    from bench.llamacpp import LlamaCppProcess

    llm = LlamaCppProcess(str(path), 1024, None).llm

    def last() -> np.ndarray:
        return np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),))

    rng = np.random.default_rng(0)
    top = max(4, min(int(llm.n_vocab()), 4000))
    llm.n_tokens = 0
    llm.eval(rng.integers(3, top, 64).tolist())
    token, started = 5, 0.0
    for step in range(steps + 2):  # two untimed
        if step == 2:
            started = time.perf_counter()
        llm.eval([token])
        token = int(np.argmax(last()))
    decode = (time.perf_counter() - started) / steps * 1e3
    times = []
    for _ in range(4):  # the first untimed
        ids = rng.integers(3, top, prompt).tolist()
        llm.n_tokens = 0
        begun = time.perf_counter()
        llm.eval(ids)
        last()
        times.append((time.perf_counter() - begun) / prompt * 1e3)
    prefill = statistics.median(times[1:])
    rng = np.random.default_rng(1)
    row_times = []
    for _ in range(4):
        llm.n_tokens = 0
        llm.eval(rng.integers(3, top, prompt).tolist())
        suffixes = [rng.integers(3, top, tokens).tolist() for _ in range(rows)]
        begun = time.perf_counter()
        for suffix in suffixes:
            llm.n_tokens = prompt
            llm.eval(suffix)
            last()
        row_times.append((time.perf_counter() - begun) * 1e3)
    return decode, prefill, statistics.median(row_times[1:])


def main(argv: list[str] | None = None) -> int:
    from runner.native import preload

    argv = sys.argv[1:] if argv is None else argv
    # as `python -m runner` runs: the BLAS and the native step are chosen at process start
    preload.reexec_preloaded("bench.gguf_load", argv)
    p = argparse.ArgumentParser(prog="python -m bench.gguf_load", description=__doc__)
    p.add_argument("--shape", choices=sorted(SHAPES), default="1b")
    p.add_argument("--layers", type=int, help="write only the shape's first LAYERS layers")
    p.add_argument("--experts", type=int, help="gpt-oss shapes: EXPERTS experts a layer")
    p.add_argument(
        "--halves",
        action="store_true",
        help="gpt-oss shapes: the matrices BF16 (Ollama's gpt-oss:20b), not Q8_0",
    )
    p.add_argument("--keep", type=Path, help="write the random GGUF here, and keep it")
    p.add_argument(
        "--file", type=Path, help="time this GGUF (or model directory) instead of a random one"
    )
    p.add_argument("--forwards", action="store_true", help="time decode steps, a prompt and rows")
    p.add_argument(
        "--llama-cpp", action="store_true", help="with --forwards: the same by llama.cpp"
    )
    args = p.parse_args(argv)
    if args.file:
        measure(args.file.expanduser(), args.forwards, llama_cpp=args.llama_cpp)
        return 0
    with tempfile.TemporaryDirectory(prefix="bench-gguf-") as tmp:
        started = time.perf_counter()
        name = f"random-{args.shape}-{'mxfp4' if args.shape in GPT_OSS else 'q4_k_m'}.gguf"
        path = Path(tmp) / name if args.keep is None else args.keep.expanduser()
        if args.shape in GPT_OSS:
            write_gpt_oss(args.shape, path, args.layers, args.experts, args.halves)
        else:
            write_gguf(args.shape, path, args.layers)
        print(f"wrote {path.name} in {time.perf_counter() - started:.1f} s")
        measure(path, args.forwards, llama_cpp=args.llama_cpp)
    return 0


if __name__ == "__main__":
    sys.exit(main())
