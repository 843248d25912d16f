"""Typed reads of values from a model's JSON files (config.json, preprocessor_config.json):
each refusal a ModelLoadError that names the file and the key, never a value left to fail
later (a string "false" read as true, a NaN size).
"""

from __future__ import annotations

import math
from typing import Any

from runner.sources.source import ModelLoadError, show


def integer(
    value: Any,
    name: str,
    *,
    minimum: int = 1,
    maximum: int | None = None,
    file: str = "config.json",
) -> int:
    """A JSON integer (not a float, not a boolean) in [minimum, maximum]."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        kind = "a positive integer" if minimum == 1 else f"an integer of at least {minimum}"
        raise ModelLoadError(f"{file}: {name} must be {kind}, not {show(value)}")
    if maximum is not None and value > maximum:
        raise ModelLoadError(f"{file}: {name} {value} is more than {maximum}")
    return value


def number(value: Any, name: str, *, file: str = "config.json") -> float:
    """A positive, finite JSON number (Python's json also reads NaN and Infinity)."""
    finite = isinstance(value, int) or (isinstance(value, float) and math.isfinite(value))
    if isinstance(value, bool) or not finite or value <= 0:
        raise ModelLoadError(f"{file}: {name} must be a positive number, not {show(value)}")
    return float(value)


def flag(value: Any, name: str, *, file: str = "config.json") -> bool:
    """A JSON boolean: a string such as "false" would be read as true."""
    if not isinstance(value, bool):
        raise ModelLoadError(f"{file}: {name} must be true or false, not {show(value)}")
    return value


def json_object(value: Any, name: str, *, file: str = "config.json") -> dict[str, Any]:
    """A JSON object; null or absent is an empty one."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ModelLoadError(f"{file}: {name} must be an object, not {show(value)}")
    return value
