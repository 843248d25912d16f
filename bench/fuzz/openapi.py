"""docs/openapi.yaml: the document read and walked (`$ref`s, operations, schemas), and an
answer (status, headers, body, or a completions stream) checked against the response the
document gives for its operation. JSON answers are parsed strictly, as Go reads them."""

from __future__ import annotations

import json
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
OPENAPI_PATH = REPO / "docs" / "openapi.yaml"


class StrictJSONError(ValueError):
    pass


def strict_json(text: str) -> Any:
    """JSON as Go reads it: NaN, Infinity and -Infinity are not JSON."""

    def constant(name: str) -> Any:
        raise StrictJSONError(f"non-JSON constant {name}")

    return json.loads(text, parse_constant=constant)


def _pointer(parts: list[str]) -> str:
    return "".join("/" + p.replace("~", "~0").replace("/", "~1") for p in parts)


class OpenAPI:
    """docs/openapi.yaml: its operations, and answers checked against them."""

    URI = "urn:runner:openapi"

    def __init__(self, path: Path = OPENAPI_PATH):
        import yaml
        from referencing import Registry, Resource
        from referencing.jsonschema import DRAFT202012

        self.doc: dict[str, Any] = yaml.safe_load(path.read_text())
        resource = Resource.from_contents(self.doc, default_specification=DRAFT202012)
        self.registry = Registry().with_resource(self.URI, resource)
        self._validators: dict[str, Any] = {}

    # navigation
    def resolve(self, obj: Any, parts: list[str]) -> tuple[Any, list[str]]:
        """Follow local `$ref`s (to a fixpoint); the object and its JSON-pointer parts."""
        while isinstance(obj, dict) and "$ref" in obj and len(obj) == 1:
            ref = obj["$ref"]
            assert ref.startswith("#/"), ref
            parts = [p.replace("~1", "/").replace("~0", "~") for p in ref[2:].split("/")]
            obj = self.doc
            for p in parts:
                obj = obj[p]
        return obj, parts

    def schema(self, name: str) -> dict[str, Any]:
        return self.doc["components"]["schemas"][name]

    def operations(self) -> Iterator[tuple[str, str]]:
        for path, item in self.doc["paths"].items():
            for method in ("get", "head", "post", "put", "patch", "delete", "options"):
                if method in item:
                    yield path, method.upper()

    def validator(self, parts: list[str]) -> Any:
        from jsonschema import Draft202012Validator

        pointer = _pointer(parts)
        if pointer not in self._validators:
            self._validators[pointer] = Draft202012Validator(
                {"$ref": f"{self.URI}#{pointer}"}, registry=self.registry
            )
        return self._validators[pointer]

    def schema_errors(self, parts: list[str], value: Any) -> list[str]:
        return [
            f"{'/'.join(map(str, e.absolute_path)) or '(root)'}: {e.message}"[:300]
            for e in self.validator(parts).iter_errors(value)
        ]

    # answers
    def check_answer(
        self,
        path: str,
        method: str,
        status: int,
        headers: dict[str, str],
        body: bytes,
        *,
        complete: bool = True,
        non_finite: bool = False,
    ) -> list[str]:
        """What is wrong with this answer according to the document ([] if nothing).

        `headers` keys are lower-case. `complete=False`: a stream the client stopped reading,
        so its last line need not end it. `non_finite=True`: the model's own logits are not
        finite, so a response marked `x-non-finite` may take the documented exception (an
        empty JSON body; a stream that ends before its Done line)."""
        item = self.doc["paths"].get(path)
        if item is None:
            return [f"{path} is not documented"]
        operation = item.get(method.lower())
        if operation is None:
            return [f"{method} {path} is not documented"]
        base = ["paths", path, method.lower(), "responses"]
        key = str(status) if str(status) in operation["responses"] else "default"
        if key not in operation["responses"]:
            return [f"{method} {path}: status {status} is not documented"]
        response, parts = self.resolve(operation["responses"][key], [*base, key])
        problems = []
        for name, header in (response.get("headers") or {}).items():
            header, _ = self.resolve(header, [])
            value = headers.get(name.lower())
            if value is None:
                if header.get("required"):
                    problems.append(f"header {name} missing")
                continue
            schema = header.get("schema") or {}
            if "const" in schema and value != schema["const"]:
                problems.append(f"header {name} is {value!r}, not {schema['const']!r}")
        if "x-location" in response and headers.get("location") != response["x-location"]:
            problems.append(f"Location {headers.get('location')!r}, not {response['x-location']!r}")
        content = response.get("content")
        if not content:
            if body:
                problems.append(f"status {status} documents no body, got {body[:80]!r}")
            return problems
        media = headers.get("content-type", "").split(";")[0].strip()
        exception = response.get("x-non-finite") if non_finite else None
        if exception == "empty-body" and not body:
            return problems
        if exception == "ends-early":
            complete = False
        if media not in content:
            return [*problems, f"content type {media!r} is not one of {sorted(content)}"]
        schema_parts = [*parts, "content", media, "schema"]
        if media == "text/plain":
            try:
                text = body.decode("utf-8")
            except UnicodeDecodeError as e:
                return [*problems, f"text/plain body is not UTF-8: {e}"]
            return problems + self.schema_errors(schema_parts, text)
        if media == "application/jsonl":
            return problems + self._check_jsonl(schema_parts, body, complete)
        try:
            value = strict_json(body.decode("utf-8"))
        except (UnicodeDecodeError, ValueError) as e:
            return [*problems, f"body is not strict JSON: {e}: {body[:120]!r}"]
        if not body.endswith(b"\n"):
            problems.append("JSON body does not end with a newline")
        return problems + self.schema_errors(schema_parts, value)

    def _check_jsonl(self, parts: list[str], body: bytes, complete: bool) -> list[str]:
        problems = []
        lines = body.split(b"\n")
        if lines and lines[-1] == b"":
            lines.pop()
        elif complete:
            problems.append("stream does not end with a newline")
        if complete and not lines:
            return ["empty stream"]
        values = []
        for n, line in enumerate(lines):
            try:
                value = strict_json(line.decode("utf-8"))
            except (UnicodeDecodeError, ValueError) as e:
                problems.append(f"line {n} is not strict JSON: {e}: {line[:120]!r}")
                continue
            values.append(value)
            problems += [f"line {n}: {p}" for p in self.schema_errors(parts, value)]
        last = values[-1] if values and isinstance(values[-1], dict) else {}
        if complete and last and last.get("Done") is not True and last.get("Error") is None:
            problems.append("the stream's last line is not Done")
        for value in values[:-1]:
            if isinstance(value, dict) and value.get("Done") is True:
                problems.append("a Done line before the end of the stream")
        return problems


@cache
def openapi() -> OpenAPI:
    return OpenAPI()
