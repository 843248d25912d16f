"""HTTP to runners for the bench: the shared helpers (tools/spawned.py), and which answers mean
"this endpoint is not there" (404/405/501) rather than a failure."""

from __future__ import annotations

from tools.spawned import HTTPStatus, KeptConnection, SpawnedRunner, get_json, post_json, post_jsonl

MISSING_ENDPOINT = (404, 405, 501)

__all__ = [
    "MISSING_ENDPOINT",
    "HTTPStatus",
    "KeptConnection",
    "SpawnedRunner",
    "get_json",
    "post_json",
    "post_jsonl",
]
