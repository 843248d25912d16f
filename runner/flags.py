"""The runner's command line, parsed as Go's `flag` package parses the Go runner's.

The supervisor writes `<exe> runner --mlx-engine --model NAME --port PORT`; everything after
the leading `runner --mlx-engine` words goes to a `flag.FlagSet` with `flag.ExitOnError`. Its
rules, kept here (docs/PROTOCOL.md §1.1):
- `-name` and `--name` are the same; `-name=value` and `-name value` for non-boolean flags;
  a boolean is set by `-name` alone or `-name=value` (`1 0 t f T F true false TRUE FALSE True
  False`), never by a following word;
- parsing stops at the first word that is not a flag, at `-` alone and after `--`;
- integers are read as Go's `strconv.ParseInt(s, 0, 64)` (`0x`, `0o`, `0b` and leading-`0`
  octal prefixes, underscores between digits);
- an unknown flag, a missing value, a bad value or bad syntax prints the error and the usage on
  stderr and exits 2; `-h`/`-help` prints the usage and exits 0.
A missing `--model` is not a flag error: the runner reports it as a start-up failure
(`Error: ...`, exit 1), as the Go runner does.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass

USAGE = """Usage of runner:
  -cache-bytes int
    \tbyte budget of the prefix caches (default: $OLLAMA_MLX_RUNNER_CACHE_BYTES or 8 GiB)
  -distributed string
    \tone rank of a process group (mlx.launch, or MLX_RANK and MLX_HOSTFILE): tensor or pipeline
  -model string
    \tOllama model name or a model directory
  -pipeline-split string
    \tlayers per rank in pipeline mode, rank 0 first (default: even)
  -port int
    \tTCP port on 127.0.0.1
  -verbose
    \tdebug logging
"""
INT64 = (-(1 << 63), (1 << 63) - 1)
_TRUE = {"1", "t", "T", "true", "TRUE", "True"}
_FALSE = {"0", "f", "F", "false", "FALSE", "False"}
_GO_INT = re.compile(
    r"[+-]?(0[xX](_?[0-9a-fA-F])+|0[oO](_?[0-7])+|0[bB](_?[01])+|0(_?[0-7])*|[1-9](_?[0-9])*)"
)


class FlagError(Exception):
    """A command line Go's flag package refuses: printed with the usage, exit 2."""


class HelpRequested(Exception):
    """-h or -help: the usage, exit 0."""


SERVE_USAGE = """Usage of serve (the runner with the OpenAI and Ollama faces):
  -cache-bytes int
    \tbyte budget of the prefix caches (default: $OLLAMA_MLX_RUNNER_CACHE_BYTES or 8 GiB)
  -distributed string
    \tone rank of a process group (mlx.launch, or MLX_RANK and MLX_HOSTFILE): tensor or pipeline
  -host string
    \taddress to listen on (default 127.0.0.1)
  -model string
    \tOllama model name or a model directory
  -pipeline-split string
    \tlayers per rank in pipeline mode, rank 0 first (default: even)
  -port int
    \tTCP port
  -verbose
    \tdebug logging
"""


@dataclass
class Flags:
    model: str = ""
    port: int = 0
    verbose: bool = False
    cache_bytes: int | None = None
    distributed: str = ""  # tensor | pipeline (runner/distributed/)
    pipeline_split: str = ""
    host: str = "127.0.0.1"
    serve: bool = False  # `serve`: the public faces too (runner/server/serve.py)


def parse_go_int(text: str) -> int:
    """strconv.ParseInt(text, 0, 64); ValueError when Go's would fail."""
    if not _GO_INT.fullmatch(text):
        raise ValueError("parse error")
    digits = text.replace("_", "")
    sign, body = (digits[0], digits[1:]) if digits[0] in "+-" else ("", digits)
    if len(body) > 1 and body[0] == "0" and body[1] not in "xXoObB":
        body = "0o" + body[1:]  # Go's leading-0 octal
    value = int(sign + body, 0)
    if not INT64[0] <= value <= INT64[1]:
        raise ValueError("value out of range")
    return value


def parse_go_bool(text: str) -> bool:
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise ValueError("parse error")


def strip_supervisor_words(argv: list[str]) -> list[str]:
    """What follows the Go supervisor's leading `runner --mlx-engine` (either word optional)."""
    args = list(argv)
    if args[:1] == ["runner"]:
        args = args[1:]
    if args[:1] in (["--mlx-engine"], ["-mlx-engine"]):
        args = args[1:]
    return args


def parse(argv: list[str]) -> Flags:
    """Go's FlagSet.Parse over the runner's flags; raises FlagError or HelpRequested."""
    flags = Flags()
    args = strip_supervisor_words(argv)
    while args:
        arg = args[0]
        if len(arg) < 2 or arg[0] != "-":
            break  # the first non-flag word ends the flags
        dashes = 2 if arg[1] == "-" else 1
        if arg == "--":
            break
        name = arg[dashes:]
        if not name or name[0] in "-=":
            raise FlagError(f"bad flag syntax: {arg}")
        args = args[1:]
        name, has_value, value = name.partition("=")
        if name in ("h", "help"):
            raise HelpRequested()
        if name == "verbose":
            try:
                flags.verbose = parse_go_bool(value) if has_value else True
            except ValueError:
                message = f'invalid boolean value "{value}" for -{name}: parse error'
                raise FlagError(message) from None
            continue
        if name not in ("model", "port", "cache-bytes", "distributed", "pipeline-split"):
            raise FlagError(f"flag provided but not defined: -{name}")
        if not has_value:
            if not args:
                raise FlagError(f"flag needs an argument: -{name}")
            value, args = args[0], args[1:]
        if name == "model":
            flags.model = value
            continue
        if name == "distributed":
            flags.distributed = value
            continue
        if name == "pipeline-split":
            flags.pipeline_split = value
            continue
        try:
            number = parse_go_int(value)
        except ValueError as e:
            raise FlagError(f'invalid value "{value}" for flag -{name}: {e}') from None
        if name == "port":
            flags.port = number
        else:
            flags.cache_bytes = number
    return flags


def parse_serve(argv: list[str]) -> Flags:
    """`serve FLAGS`: the runner's flags (as Go parses them) and `-host`."""
    args, rest, host = list(argv), [], "127.0.0.1"
    while args:
        arg = args.pop(0)
        name, has_value, value = arg.lstrip("-").partition("=")
        if arg.startswith("-") and name == "host" and arg not in ("-", "--"):
            if not has_value:
                if not args:
                    raise FlagError("flag needs an argument: -host")
                value = args.pop(0)
            host = value
            continue
        rest.append(arg)
        if not arg.startswith("-") or arg in ("-", "--"):
            rest += args  # the flags end here
            break
        if has_value or name in ("verbose", "h", "help") or not args:
            continue
        rest.append(args.pop(0))  # a flag's value
    flags = parse(rest)
    flags.host, flags.serve = host, True
    return flags


def parse_or_exit(argv: list[str]) -> Flags:
    """`parse` (`parse_serve` after a leading `serve`), exiting as flag.ExitOnError does:
    usage and 2 on an error, 0 on -help."""
    serve = argv[:1] == ["serve"]
    usage = SERVE_USAGE if serve else USAGE
    try:
        return parse_serve(argv[1:]) if serve else parse(argv)
    except HelpRequested:
        sys.stderr.write(usage)
        raise SystemExit(0) from None
    except FlagError as e:
        sys.stderr.write(f"{e}\n{usage}")
        raise SystemExit(2) from None
