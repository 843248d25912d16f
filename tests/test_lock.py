"""The pinned installs (tools/lock.py, constraints.txt): what the tests run on is the lock."""

from __future__ import annotations

import tomllib

import pytest
from packaging.requirements import Requirement

from tools.lock import EXTRAS, LOCK, ROOT, canonical, installed, mismatches, pins


def test_this_environment_is_the_lock() -> None:
    """What scripts/setup checks after installing, checked again by the suite it runs."""
    assert mismatches(pins(LOCK.read_text()), installed()) == []


def test_every_requirement_of_pyproject_is_pinned() -> None:
    """A dependency added to pyproject.toml without `python -m tools.lock update` fails."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = list(project["dependencies"])
    for extra in EXTRAS:
        wanted += project["optional-dependencies"][extra]
    locked = {
        canonical(Requirement(line.split("#")[0]).name)
        for line in LOCK.read_text().splitlines()
        if line.split("#")[0].strip()
    }
    names = {canonical(Requirement(text).name) for text in wanted}
    assert names - locked == set()
    assert set(project["optional-dependencies"]) - set(EXTRAS) == set(), "an extra not locked"


def test_pins_follow_markers_and_versions_must_match_exactly() -> None:
    lock = "\n".join(
        [
            "torch==2.13.0",
            "    # via ollama-mlx-runner",
            "numpy==2.4.6 ; python_version < '3.0'",  # never applies
            "numpy==2.5.5 ; python_version >= '3.0'",
            "Typing_Extensions==4.16.0",
        ]
    )
    pinned = pins(lock)
    assert pinned == {"torch": "2.13.0", "numpy": "2.5.5", "typing-extensions": "4.16.0"}
    present = {
        "torch": "2.13.0+cpu",  # a local build of the pinned release
        "numpy": "2.5.6",
        "typing-extensions": "4.16.0",
        "requests": "2.34.2",
        "pip": "23.2.1",
        "ollama-mlx-runner": "0.1.0",
    }
    assert mismatches(pinned, present) == [
        "numpy 2.5.6 is installed; the lock pins 2.5.5",
        "requests 2.34.2 is installed but not pinned",
    ]


def test_a_range_is_not_a_pin() -> None:
    with pytest.raises(ValueError, match="not an exact pin"):
        pins("transformers>=5")
