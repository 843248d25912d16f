"""llama.cpp (through llama-cpp-python) on a GGUF converted from the same model directory.

- `llama.cpp-f32`: a float32 GGUF and a float32 KV cache: the same arithmetic as ours, so
  its logits are checked against ours like any other system's.
- `llama.cpp-f16`: a float16 GGUF (lossless for a checkpoint stored in float16, as the
  default model is: the weights' bytes ours reads from its half copies), float32 KV cache.
  llama.cpp rounds the activations to float16 for these products, so its logits differ a
  little from ours; the columns say by how much.
- `llama.cpp-q4`: Q4_K_M quantized from that GGUF, default (f16) KV cache: what a llama.cpp
  user runs. Its logits differ from ours by the quantization; the columns say by how much.
- `llama.cpp-q4_0`, `llama.cpp-q8_0`: the same on Q4_0 and Q8_0 files (llama.cpp's
  quantizer's types of those names: every matrix in one type, the head or embedding in Q6_K
  or Q8_0 as llama-quantize chooses).
- `llama.cpp-q5`: the same on a Q5_K_M file (Q5_K where rows are whole blocks of 256, Q6_K
  for some, llama-quantize's fallbacks elsewhere): the 5-bit codes the runner's decode steps
  take as limbs.
- `llama.cpp-q3`, `llama.cpp-q2`: the same on Q3_K_M and Q2_K files (Ollama's `q3_K_M` and
  `q2_K` tags: mostly Q3_K, Q2_K, with Q4_K, Q5_K and a Q6_K head).
- `llama.cpp-iq4`: the same on an IQ4_XS file (the i-quant GGUFs others publish: IQ4_XS where
  rows are whole blocks of 256, IQ4_NL where they are not, e.g. most of SmolLM2's).

Each runs in a process of its own (spawned: no MLX, no torch in it), as a user runs llama.cpp,
and keeps one `Llama` with n_threads = n_threads_batch = the machine's cores and reuses
their KV cache across rows, as llama.cpp's server does between requests: a row's longest
common prefix with the tokens evaluated last is kept, the rest evaluated (one token at least,
for the last position's logits). Text is tokenized by llama.cpp's own tokenizer, without BOS
as /v1/score does; a candidate is the one token it appends to the prompt, as ours checks.

The GGUFs are made once and kept next to the model (`<dir>/../<dir name>.gguf/`), with a
stamp of the directory's files (names, sizes, modification times) and the llama-cpp-python
version, so a changed model is converted again. Conversion runs llama.cpp's
convert_hf_to_gguf.py (it needs torch and transformers: the reference extra) from
`--llama-cpp-src DIR`, `$LLAMA_CPP_SRC`, or else the sdist of the installed llama-cpp-python,
downloaded once with pip into the cache (only the converter, its `gguf-py` and `conversion`
are kept). llama-cpp-python itself is optional (`pip install '.[llama]'`): without it both
systems are skipped.

A llama.cpp process that dies under a call (a signal, an exit) is noticed while the bench
waits for its answer, and the call raises `Died` with how it ended: "llama.cpp process died:
SIGILL", with one more clause where the cause is known, e.g. the AMX kernels of a native
build whose tile loads fault on a VM that lists the AMX flags (bench/README.md, "llama.cpp
builds", gives the build that runs there). The process reports its `llama_print_system_info()`
when it is ready, for that clause.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import importlib.util
import json
import logging
import multiprocessing
import os
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.base import (
    Context,
    Died,
    GenerateOutcome,
    ScoreOutcome,
    Skipped,
    System,
    exit_reason,
    limited,
    score_rows,
)
from bench.models import llama_cpp_pre_tokenizer
from bench.workloads import GenerateWorkload, Row

CONVERTER = "convert_hf_to_gguf.py"
# What the converter needs beside itself, under the sdist's vendor/llama.cpp/.
CONVERTER_PATHS = (CONVERTER, "gguf-py/", "conversion/")
SDIST_ROOT = "vendor/llama.cpp/"
N_CTX = 4096  # at most the model's context; every default workload's rows fit
F32, F16, Q4 = "f32.gguf", "f16.gguf", "q4_k_m.gguf"
Q4_0, Q8_0, Q5 = "q4_0.gguf", "q8_0.gguf", "q5_k_m.gguf"
Q3, Q2, IQ4 = "q3_k_m.gguf", "q2_k.gguf", "iq4_xs.gguf"
# llama.cpp's quantizer's file types (LLAMA_FTYPE_MOSTLY_*) of the quantized files
QUANTIZED = {
    Q4: "Q4_K_M", Q4_0: "Q4_0", Q8_0: "Q8_0", Q5: "Q5_K_M", Q3: "Q3_K_M", Q2: "Q2_K",
    IQ4: "IQ4_XS",
}  # fmt: skip
STAMP = "source.json"
POLL_S = 0.2  # how often a wait for the llama.cpp process's answer checks that it lives
REAP_S = 5.0  # how long its pipe's end waits for the process to be reaped

# Runs convert_hf_to_gguf.py with argv[1] on sys.path (for its `conversion` package); when
# argv[2] names a pre-tokenizer, the converter's recognition by token hash is replaced by it
# (bench/models.py `llama_cpp_pre_tokenizer` says why our directories need that).
CONVERT = """
import runpy, sys
src, pre = sys.argv[1], sys.argv[2]
sys.path.insert(0, src)
if pre:
    from conversion.base import TextModel
    TextModel.get_vocab_base_pre = lambda self, tokenizer: pre
sys.argv = [src + "/convert_hf_to_gguf.py", *sys.argv[3:]]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def import_llama_cpp() -> Any:
    """The llama_cpp module; Skipped when llama-cpp-python is not installed."""
    try:
        import llama_cpp
    except ImportError as e:
        raise Skipped(f"llama-cpp-python is not installed (pip install '.[llama]'): {e}") from None
    # Its log callback prints every llama.cpp message (quantization's per tensor) otherwise.
    logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)
    return llama_cpp


def sdist_cache(version: str) -> Path:
    from runner.sources.default_model import cache_root

    return cache_root() / "llama-cpp-src" / version


def converter_source(given: Path | None, version: str) -> Path:
    """A directory holding convert_hf_to_gguf.py, gguf-py/ and conversion/: `given`
    (--llama-cpp-src), $LLAMA_CPP_SRC, or the sdist of llama-cpp-python `version`,
    downloaded and extracted into the cache on first use."""
    env = os.environ.get("LLAMA_CPP_SRC", "").strip()
    for source, path in (("--llama-cpp-src", given), ("LLAMA_CPP_SRC", Path(env) if env else None)):
        if path is not None:
            if not (path / CONVERTER).is_file():
                raise ValueError(f"{source} {path} holds no {CONVERTER}")
            return path
    target = unpacked_sdist(version)
    if target is not None and (target / CONVERTER).is_file():
        return target
    target = sdist_cache(version)
    with tempfile.TemporaryDirectory(prefix="llama-cpp-sdist-") as tmp:
        pip = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:"]
        done = subprocess.run(
            [*pip, f"llama-cpp-python=={version}", "-d", tmp], capture_output=True, text=True
        )
        archives = list(Path(tmp).glob("*.tar.gz"))
        if done.returncode != 0 or not archives:
            tail = (done.stderr or done.stdout).strip().splitlines()[-1:]
            raise Skipped(
                f"could not download the llama-cpp-python {version} sdist for {CONVERTER} "
                f"(give --llama-cpp-src DIR): {' '.join(tail)}"
            )
        _unpack_sdist(archives[0], target)
    return target


def unpacked_sdist(version: str) -> Path | None:
    """The sdist cache's tree for llama-cpp-python `version` (sdist_cache: the converter's
    files and llama.cpp's ggml-vocab-* test vocabularies), unpacked where need be from the
    tarball scripts/setup downloads beside it (no network); None when neither is there."""
    target = sdist_cache(version)
    tarball = target.parent / f"llama_cpp_python-{version}.tar.gz"
    if tarball.is_file() and not ((target / CONVERTER).is_file() and (target / "models").is_dir()):
        _unpack_sdist(tarball, target)
    return target if target.is_dir() else None


def _unpack_sdist(tarball: Path, target: Path) -> None:
    """The converter's files and the vocabularies of the sdist `tarball` into `target`
    (vendor/llama.cpp/ stripped; written by us, so no member lands outside it). Each tree
    `target` lacks is moved in whole, the converter itself last: what the checks above look
    for is there only once its tree is."""
    vocabularies = SDIST_ROOT + "models/ggml-vocab-"
    converter = [SDIST_ROOT + p for p in CONVERTER_PATHS]
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="llama-cpp-sdist-", dir=target.parent) as tmp:
        staging = Path(tmp) / "src"
        with tarfile.open(tarball) as tar:
            for member in tar.getmembers():
                _, _, inner = member.name.partition("/")
                if not member.isfile() or ".." in Path(inner).parts:
                    continue
                if not inner.startswith(vocabularies) and not any(
                    inner == p or (p.endswith("/") and inner.startswith(p)) for p in converter
                ):
                    continue
                out = staging / inner[len(SDIST_ROOT) :]
                out.parent.mkdir(parents=True, exist_ok=True)
                source = tar.extractfile(member)
                assert source is not None
                out.write_bytes(source.read())
        target.mkdir(exist_ok=True)
        for tree in sorted(staging.iterdir(), key=lambda tree: tree.name == CONVERTER):
            try:
                os.replace(tree, target / tree.name)
            except OSError:
                if not (target / tree.name).exists():  # else another process moved it first
                    raise


def source_stamp(model_dir: Path, version: str) -> dict[str, Any]:
    """What the GGUFs were made from: the directory's files and the converter version."""
    files = sorted(p for p in model_dir.iterdir() if p.is_file())
    listing = [(p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in files]
    digest = hashlib.sha256(json.dumps(listing).encode()).hexdigest()
    return {"model_dir": str(model_dir.resolve()), "files": digest, "llama_cpp_python": version}


def convert(model_dir: Path, out: Path, src: Path, log: Path, outtype: str = "f32") -> None:
    """convert_hf_to_gguf.py --outtype `outtype` as a subprocess, its own gguf-py first on
    the path (it must win over an installed gguf); the output appears complete or not at
    all."""
    missing = [m for m in ("torch", "transformers") if importlib.util.find_spec(m) is None]
    if missing:
        raise Skipped(f"converting to GGUF needs {', '.join(missing)} (pip install '.[reference]')")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(src / "gguf-py"), env.get("PYTHONPATH")) if p
    )
    partial = out.with_suffix(".partial")
    pre = llama_cpp_pre_tokenizer(model_dir) or ""
    command = [sys.executable, "-c", CONVERT, str(src), pre, str(model_dir)]
    command += ["--outtype", outtype, "--outfile", str(partial)]
    with log.open("w") as sink:
        done = subprocess.run(command, env=env, stdout=sink, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        last = log.read_text().strip().splitlines()[-1:]
        raise RuntimeError(f"{CONVERTER} failed (see {log}): {' '.join(last)}")
    os.replace(partial, out)


def quantize(llama_cpp: Any, source: Path, out: Path, kind: str = "Q4_K_M") -> None:
    """`kind` (one of QUANTIZED's: a LLAMA_FTYPE_MOSTLY_*) from the f32 GGUF with
    llama.cpp's own quantizer (llama-quantize's code)."""
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{kind}")
    params.nthread = os.cpu_count() or 1
    partial = out.with_suffix(".partial")
    status = llama_cpp.llama_model_quantize(
        str(source).encode(), str(partial).encode(), ctypes.byref(params)
    )
    if status != 0:
        raise RuntimeError(f"llama_model_quantize failed ({status}) on {source}")
    os.replace(partial, out)


def cached_gguf(llama_cpp: Any, ctx: Context, name: str) -> Path:
    """The GGUF `name` (F32, F16 or one of QUANTIZED) of ctx.model_dir, made on first use or
    after a change."""
    model_dir = Path(ctx.model_dir)
    version = llama_cpp.__version__
    cache = model_dir.parent / f"{model_dir.name}.gguf"
    stamp = source_stamp(model_dir, version)
    stamp_path = cache / STAMP
    if not stamp_path.exists() or json.loads(stamp_path.read_text()) != stamp:
        cache.mkdir(parents=True, exist_ok=True)
        for old in (stamp_path, cache / F32, cache / F16, *(cache / q for q in QUANTIZED)):
            old.unlink(missing_ok=True)
        src = converter_source(ctx.llama_cpp_src, version)
        convert(model_dir, cache / F32, src, cache / "convert.log")
        stamp_path.write_text(json.dumps(stamp, indent=2))
    if name == F16 and not (cache / name).exists():
        src = converter_source(ctx.llama_cpp_src, version)
        convert(model_dir, cache / F16, src, cache / "convert-f16.log", "f16")
    if not (cache / name).exists():
        quantize(llama_cpp, cache / F32, cache / name, QUANTIZED[name])
    return cache / name


class LlamaCppProcess:
    """One `Llama` in this process: what runs in the llama.cpp system's own process."""

    def __init__(self, path: str, max_tokens: int, kv_type: str | None):
        llama_cpp = import_llama_cpp()
        cores = os.cpu_count() or 1
        kv = {}
        if kv_type is not None:
            kv = {"type_k": getattr(llama_cpp, kv_type), "type_v": getattr(llama_cpp, kv_type)}
        self.llm = llama_cpp.Llama(
            model_path=path,
            n_ctx=min(N_CTX, max_tokens),
            n_threads=cores,
            n_threads_batch=cores,
            logits_all=False,  # only the last position's logits: all scoring reads
            verbose=False,
            **kv,
        )

    def _encode(self, text: str, bos: bool = False) -> list[int]:
        return self.llm.tokenize(text.encode(), add_bos=bos, special=False)

    def _candidate(self, prompt: str, tokens: list[int], candidate: str) -> int:
        joined = self._encode(prompt + candidate)
        if len(joined) != len(tokens) + 1 or joined[: len(tokens)] != tokens:
            raise ValueError(f"candidate {candidate!r} is not one token after the prompt")
        return joined[-1]

    def _evaluate(self, tokens: list[int]) -> int:
        """Bring the KV cache to `tokens`, reusing its longest common prefix with what was
        evaluated last (all but one token at most: the last position's logits are needed);
        returns the tokens evaluated. Llama.eval drops the cache past `n_tokens` itself."""
        llm = self.llm
        if len(tokens) > llm.n_ctx():
            raise ValueError(f"{len(tokens)} tokens exceed n_ctx {llm.n_ctx()}")
        cached = llm.input_ids[: llm.n_tokens]
        n = min(len(cached), len(tokens))
        differ = np.flatnonzero(cached[:n] != np.asarray(tokens[:n]))
        keep = min(int(differ[0]) if differ.size else n, len(tokens) - 1)
        llm.n_tokens = keep
        llm.eval(tokens[keep:])
        return len(tokens) - keep

    def _last_logits(self) -> np.ndarray:
        llm = self.llm
        return np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),))

    def score(self, rows: list[Row]) -> ScoreOutcome:
        def score_row(row: Row) -> tuple[list[float | None], int]:
            tokens = self._encode(row.prompt)
            wanted = [self._candidate(row.prompt, tokens, c) for c in row.candidates]
            computed = self._evaluate(tokens)
            logits = self._last_logits()
            return [float(logits[i]) for i in wanted], computed

        return score_rows(rows, score_row)

    def generate(self, workload: GenerateWorkload, new_tokens: int) -> GenerateOutcome:
        """Greedy: the prompt's forward gives the first token (prefill), then one forward per
        token; decode_seconds spans the n - 1 forwards that give tokens 2..n (decode_tokens).
        BOS only where the GGUF's add_bos_token says, as ours follows tokenizer_config."""
        llm = self.llm
        tokens = self._encode(workload.prompt, bos=True)
        llm.reset()  # a prompt is prefilled whole, as the other systems do
        started = time.perf_counter()
        llm.eval(tokens)
        out = [int(np.argmax(self._last_logits()))]
        prefilled = time.perf_counter()
        while len(out) < new_tokens and out[-1] != llm.token_eos():
            llm.eval([out[-1]])
            out.append(int(np.argmax(self._last_logits())))
        ended = time.perf_counter()
        if out[-1] == llm.token_eos():  # not text, and not counted: as EvalCount
            text_tokens = out[:-1]
        else:
            text_tokens = out
        return GenerateOutcome(
            text=llm.detokenize(text_tokens).decode("utf-8", errors="replace"),
            prompt_tokens=len(tokens),
            new_tokens=len(text_tokens),
            prefill_seconds=prefilled - started,
            decode_seconds=ended - prefilled,
            decode_tokens=len(out) - 1,
        )


def _serve(connection: Any, path: str, max_tokens: int, kv_type: str | None) -> None:
    """The llama.cpp process: say it is ready (with llama.cpp's system info), then answer
    (method, args) calls until told to stop."""
    engine = LlamaCppProcess(path, max_tokens, kv_type)
    info = import_llama_cpp().llama_print_system_info().decode(errors="replace")
    connection.send(("ready", " ".join(info.split())))
    while (call := connection.recv()) is not None:
        method, args = call
        try:
            connection.send(("ok", getattr(engine, method)(*args)))
        except Exception as e:  # reported to the bench, which fails this workload
            connection.send(("error", f"{type(e).__name__}: {e}"))


def fault_hint(returncode: int, system_info: str) -> str:
    """What a llama.cpp process's death says about its build, in one clause ("" if
    nothing): a SIGILL is an instruction the build uses that faults here."""
    if returncode != -signal.SIGILL:
        return ""
    if "AMX_INT8 = 1" in system_info:
        return (
            "; its build runs AMX kernels (AMX_INT8 = 1), whose tile loads fault on this"
            " machine: build llama-cpp-python without AMX (bench/README.md, llama.cpp builds)"
        )
    return (
        "; its build uses an instruction this CPU does not run: build llama-cpp-python for"
        " this machine (bench/README.md, llama.cpp builds)"
    )


class LlamaCpp(System):
    """llama.cpp in a process of its own, as a user runs it. In the bench's own process its
    threads share the machine with MLX's and ran 2x slower (a one-row request over a cached
    prompt: 88 -> 200 ms, measured with MLX merely imported and used once)."""

    name = "llama.cpp-f32"
    description = "llama-cpp-python in its own process, f32 GGUF, f32 KV cache; prefix reuse"
    one_by_one = True
    process_name = "llama.cpp"
    gguf = F32
    kv_type: str | None = "GGML_TYPE_F32"  # None: llama.cpp's default (f16)
    serve = staticmethod(_serve)  # what runs in the process (a test gives its own)
    process: Any = None
    system_info = ""

    def prepare(self, ctx: Context) -> None:
        llama_cpp = import_llama_cpp()
        path = cached_gguf(llama_cpp, ctx, self.gguf)
        self.start(str(path), ctx.max_tokens)

    def start(self, path: str, max_tokens: int) -> None:
        """Spawn the process serving `path` and wait until it is ready."""
        spawn = multiprocessing.get_context("spawn")  # a clean process: no MLX, no torch
        self.connection, child = spawn.Pipe()
        self.process = spawn.Process(
            target=self.serve, args=(child, path, max_tokens, self.kv_type), daemon=True
        )
        self.process.start()
        child.close()
        self.system_info = self._answer() or ""

    def _died(self) -> Died:
        code = self.exit_code(REAP_S)
        if code is None:
            return Died(f"{self.process_name} process closed its pipe but still runs")
        return Died(exit_reason(self.process_name, code) + fault_hint(code, self.system_info))

    def _answer(self) -> Any:
        """The process's answer, checking every POLL_S that it still lives: a process that
        dies under a call raises Died rather than leaving the bench waiting."""
        try:
            while not self.connection.poll(POLL_S):
                if not self.process.is_alive():
                    raise self._died()
            status, value = self.connection.recv()
        except (EOFError, OSError):  # its end of the pipe closed: it died
            raise self._died() from None
        if status == "error":
            raise RuntimeError(value)
        return value

    def _call(self, method: str, *args: Any) -> Any:
        try:
            self.connection.send((method, args))
        except OSError:  # BrokenPipeError: it is gone
            raise self._died() from None
        return self._answer()

    def exit_code(self, wait: float = 0.0) -> int | None:
        if self.process is None:
            return None
        if wait > 0 and self.process.is_alive():
            self.process.join(wait)
        return self.process.exitcode

    def close(self) -> None:
        """Stop the process, whatever state it is in (dead, hung, half started)."""
        if self.process is None:
            return
        if self.process.is_alive():
            with contextlib.suppress(OSError, ValueError):
                self.connection.send(None)
            self.process.join(timeout=30)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(timeout=REAP_S)
        with contextlib.suppress(OSError):
            self.connection.close()

    def score(self, requests: list[list[Row]], limit: int | None) -> ScoreOutcome:
        return self._call("score", limited(requests, limit))

    def generate(self, workload: GenerateWorkload, new_tokens: int) -> GenerateOutcome:
        return self._call("generate", workload, new_tokens)


class LlamaCppF16(LlamaCpp):
    name = "llama.cpp-f16"
    description = "llama-cpp-python, f16 GGUF (the checkpoint's own bytes), f32 KV cache"
    gguf = F16


class LlamaCppQ4(LlamaCpp):
    name = "llama.cpp-q4"
    description = "llama-cpp-python, Q4_K_M GGUF, f16 KV cache (llama.cpp's defaults)"
    gguf = Q4
    kv_type = None


class LlamaCppQ40(LlamaCppQ4):
    name = "llama.cpp-q4_0"
    description = "llama-cpp-python, Q4_0 GGUF, f16 KV cache (llama.cpp's defaults)"
    gguf = Q4_0


class LlamaCppQ80(LlamaCppQ4):
    name = "llama.cpp-q8_0"
    description = "llama-cpp-python, Q8_0 GGUF, f16 KV cache (llama.cpp's defaults)"
    gguf = Q8_0


class LlamaCppQ5(LlamaCppQ4):
    name = "llama.cpp-q5"
    description = "llama-cpp-python, Q5_K_M GGUF, f16 KV cache (llama.cpp's defaults)"
    gguf = Q5


class LlamaCppQ3(LlamaCppQ4):
    name = "llama.cpp-q3"
    description = "llama-cpp-python, Q3_K_M GGUF, f16 KV cache (llama.cpp's defaults)"
    gguf = Q3


class LlamaCppQ2(LlamaCppQ4):
    name = "llama.cpp-q2"
    description = "llama-cpp-python, Q2_K GGUF, f16 KV cache (llama.cpp's defaults)"
    gguf = Q2


class LlamaCppIQ4(LlamaCppQ4):
    name = "llama.cpp-iq4"
    description = "llama-cpp-python, IQ4_XS GGUF, f16 KV cache (llama.cpp's defaults)"
    gguf = IQ4
