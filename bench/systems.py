"""The systems a run can compare, by name, in the order they run (ours first: the others
are checked against it)."""

from __future__ import annotations

from bench.base import System
from bench.llamacpp import (
    LlamaCpp,
    LlamaCppF16,
    LlamaCppIQ4,
    LlamaCppQ2,
    LlamaCppQ3,
    LlamaCppQ4,
    LlamaCppQ5,
    LlamaCppQ40,
    LlamaCppQ80,
)
from bench.ours import (
    Ours,
    OursHTTP,
    OursIQ4,
    OursQ2,
    OursQ3,
    OursQ4,
    OursQ5,
    OursQ40,
    OursQ80,
    OursRows,
)
from bench.peers import Baseline, MlxLm, Transformers

SYSTEMS: dict[str, type[System]] = {
    cls.name: cls
    for cls in (
        Ours,
        OursRows,
        OursHTTP,
        OursQ4,
        OursQ40,
        OursQ80,
        OursQ5,
        OursQ3,
        OursQ2,
        OursIQ4,
        Baseline,
        MlxLm,
        Transformers,
        LlamaCpp,
        LlamaCppF16,
        LlamaCppQ4,
        LlamaCppQ40,
        LlamaCppQ80,
        LlamaCppQ5,
        LlamaCppQ3,
        LlamaCppQ2,
        LlamaCppIQ4,
    )
}
NAMES = tuple(SYSTEMS)


def make_systems(names: list[str]) -> list[System]:
    unknown = [n for n in names if n not in SYSTEMS]
    if unknown:
        raise ValueError(f"unknown systems {unknown} (known: {', '.join(NAMES)})")
    return [SYSTEMS[n]() for n in NAMES if n in names]  # always in the canonical order
