"""The pinned installs: `constraints.txt` at the repository root holds an exact version of
every package the runner, its tests and its reference tier install, for every platform the
project supports (markers say where a pin applies), so that a new release of anything never
changes what CI runs.

- `python -m tools.lock check` (run by `scripts/setup` after every install): every
  distribution in this environment is pinned and installed at its pinned version; exit 1
  naming each one that is not. Local version labels are ignored (`2.13.0+cpu` is `2.13.0`).
- `python -m tools.lock update [--upgrade | --upgrade-package NAME ...]`: resolves
  pyproject.toml's dependencies and extras again with uv (pinned below, run from a throwaway
  virtual environment) into `constraints.txt`, for Linux and macOS and every supported Python
  at once (`uv pip compile --universal`). Without an upgrade flag the pins already in the
  file are kept where they still satisfy pyproject.toml. Moving a pin is a commit of its own
  that reruns the goldens (README.md, "Moving a pin").

`scripts/setup` installs with `PIP_CONSTRAINT` set to the file, so pip's build environments
(setuptools for the editable install) are pinned too.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LOCK = ROOT / "constraints.txt"
UV = "uv==0.13.9"
# The extras the lock covers: what scripts/setup installs (test, prepare, reference, eval) and
# the bench's llama.cpp. The project itself is not pinned (it is installed from the checkout).
EXTRAS = ("test", "prepare", "reference", "eval", "llama")
PROJECT = "ollama-mlx-runner"
# Installed by the virtual environment itself, not by the project's requirements.
UNLOCKED = {PROJECT, "pip"}


def canonical(name: str) -> str:
    """PEP 503's normalised name (`Jinja2` and `jinja2`, `typing_extensions` and
    `typing-extensions` are one package)."""
    return "-".join(part for part in name.lower().replace("_", "-").replace(".", "-").split("-"))


def public(version: str) -> str:
    """The version without its local label (`2.13.0+cpu` -> `2.13.0`)."""
    return version.split("+", 1)[0]


def pins(text: str) -> dict[str, str]:
    """The lock's exact pins that apply in this environment: name -> version."""
    from packaging.requirements import Requirement

    out: dict[str, str] = {}
    for raw in text.splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        requirement = Requirement(line)
        if requirement.marker is not None and not requirement.marker.evaluate():
            continue
        versions = [spec.version for spec in requirement.specifier if spec.operator == "=="]
        if len(versions) != 1 or len(requirement.specifier) != 1:
            raise ValueError(f"{LOCK.name}: not an exact pin: {line!r}")
        out[canonical(requirement.name)] = versions[0]
    return out


def installed() -> dict[str, str]:
    """Every distribution of this environment: name -> version."""
    return {
        canonical(dist.metadata["Name"]): dist.version
        for dist in importlib.metadata.distributions()
        if dist.metadata["Name"]
    }


def mismatches(pinned: dict[str, str], present: dict[str, str]) -> list[str]:
    """What differs from the lock, one line each: a version other than the pin, or a
    package the lock does not pin."""
    problems = []
    for name, version in sorted(present.items()):
        if name in UNLOCKED:
            continue
        if name not in pinned:
            problems.append(f"{name} {version} is installed but not pinned")
        elif public(version) != pinned[name]:
            problems.append(f"{name} {version} is installed; the lock pins {pinned[name]}")
    return problems


def check(lock: Path = LOCK) -> int:
    problems = mismatches(pins(lock.read_text()), installed())
    for line in problems:
        print(f"{lock.name}: {line}", file=sys.stderr)
    if problems:
        print(
            f"Error: this environment differs from {lock.name} (README.md, 'Pinned installs')",
            file=sys.stderr,
        )
        return 1
    return 0


def update(upgrade: bool, packages: list[str]) -> int:
    with tempfile.TemporaryDirectory(prefix="uv-") as tmp:
        venv = Path(tmp) / "venv"
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", UV], check=True)
        command = [
            str(venv / "bin" / "uv"),
            "pip",
            "compile",
            "pyproject.toml",
            "--universal",
            "--quiet",
            "--output-file",
            LOCK.name,
            "--custom-compile-command",
            "python -m tools.lock update",
            *(arg for extra in EXTRAS for arg in ("--extra", extra)),
        ]
        if upgrade:
            command.append("--upgrade")
        for package in packages:
            command += ["--upgrade-package", package]
        env = {**os.environ, "UV_CACHE_DIR": str(Path(tmp) / "cache")}
        return subprocess.run(command, cwd=ROOT, env=env).returncode


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.lock", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("check", help="this environment against the lock")
    up = commands.add_parser("update", help="resolve the lock again with uv")
    up.add_argument("--upgrade", action="store_true", help="move every pin to its newest")
    up.add_argument("--upgrade-package", action="append", default=[], metavar="NAME")
    args = parser.parse_args(argv)
    if args.command == "check":
        return check()
    return update(args.upgrade, args.upgrade_package)


if __name__ == "__main__":
    sys.exit(main())
