"""The fuzz's bodies: documents built from docs/openapi.yaml's request schemas with the tiny
model's vocabulary (so most are valid), then mutated (wrong types, edge numbers, deep
nesting, duplicate and re-spelled keys, invalid UTF-8, trailing data, ...); `generate_cases`
draws a fixed list of them from a seed with Hypothesis."""

from __future__ import annotations

import copy
import random
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from bench.fuzz.client import MIB
from bench.fuzz.nodes import Arr, Lit, Num, Obj, Str, serialize
from bench.fuzz.openapi import OpenAPI, openapi

# The tiny model's text (tests/tiny.py CORPUS): these tokenize to a few tokens each, and the
# candidates are (mostly) single tokens after them.
# fmt: off
PREFIXES = (
    "",
    "Answer with Yes or No.\n",
    "The quick brown fox jumps over the lazy dog. A small model reads a short story.\n",
    "Is the sky blue? Yes. Is grass red? No. Is it? Yes. Is it? No.\n" * 3,
)
QUESTIONS = (
    "Is the sky blue?", "Is grass red?", "Is it?", "Answer: A, B, C or", "The cat sat on the",
    "Q: Is the sea wet?\nA:", "Numbers like 1, 2, 3 and", "names such as Alice, Bob and",
    "The dog slept by the",
)
CANDIDATES = (
    " Yes", " No", " A", " B", " C", " D", " the", " a", " is", " sky", " blue", "?", "!", ".",
    ",", " Yes.", "<|im_end|>", "", " ",
)
KEYS_UNKNOWN = ("x", "model", "stream", "format", "foo_bar", "Images", "rows_", "", "🙂", "num")
EDGE_NUMBERS = (
    "0", "-0", "1", "-1", "2", "7", "26", "27", "64", "65", "255", "256", "2047", "2048", "2049",
    "2147483647", "2147483648", "-2147483649", "4294967296", "9007199254740993",
    "9223372036854775807", "-9223372036854775808", "9223372036854775808",
    "-9223372036854775809", "18446744073709551615", "18446744073709551616",
    "100000000000000000000000000000", "1.0", "0.5", "-0.0", "1e2", "1E+2", "1e-7",
    "3.4028234663852886e38", "3.4028235e38", "3.4028236e38", "3.5e38", "1e39",
    "1.7976931348623157e308", "1e308", "1e309", "4.9e-324", "1e-400", "-1e39", "0.1", "1e400",
)
OVERFLOW_INTS = (
    "9223372036854775808", "-9223372036854775809", "18446744073709551615",
    "18446744073709551616", "99999999999999999999999", "-99999999999999999999999", "1" + "0" * 60,
)
NON_FINITE = (b"NaN", b"-NaN", b"Infinity", b"-Infinity", b"nan", b"inf", b"1e999", b"-1e999")
INVALID_UTF8 = (
    b"\xff", b"\xfe", b"\x80", b"\xc3", b"\xc3\x28", b"\xe2\x82", b"\xed\xa0\x80", b"\xed\xbf\xbf",
    b"\xc0\xaf", b"\xf4\x90\x80\x80", b"\xf0\x9f\x98", b"\xf8\x88\x80\x80\x80",
)
SURROGATES = (
    b"\\ud800", b"\\udc00", b"\\uDFFF", b"\\udbff", b"\\ud83d\\u0041", b"\\ud83d\\ude00",
    b"\\ud800\\ud800", b"\\udc00\\ud800",
)
BAD_ESCAPES = (b"\\x41", b"\\U0041", b"\\u12", b"\\u12G4", b"\\a", b"\\'", b"\\")
CONTROL = (b"\x00", b"\x01", b"\t", b"\n", b"\r", b"\x1b", b"\x1f", b"\\u0000", b"\\u001f", b"\x7f")
TRAILING = (
    b" x", b"{}", b"}", b"]", b'\n{"a":1}', b"garbage", b"\x00", b",", b"\xff", b"   null", b"\n",
    b"\r\n\t ", b"[", b'"', b"0", b'{"Prompt":"other"}',
)
EMPTY_BODIES = (
    b"", b" ", b"\n\t\r ", b"null", b" null ", b"{}", b"[]", b"0", b'""', b"true", b"nul", b"{",
    b"[", b"\xef\xbb\xbf{}", b"[{}]", b"nullx", b"{}}", b"\x00",
)
BAD_BASE64 = (
    "!!!!", "aGk", "aGk=\n", "a===", "====", "aGk=aGk=", "aGVsbG8", " aGk=", "aGk=\r\n", "YQ",
    "_-_-", "aGk\u00e9", "aG k=", "aGk==", "=aGk",
)
GOOD_BASE64 = ("", "aGk=", "iVBORw0KGgo=", "AAAA", "aGVs\nbG8=")
KINDS = ("image", "audio", "", "video", "IMAGE")
DEEP_DEPTHS = (32, 500, 999, 1000, 1001, 2000, 5000, 9998, 10001, 50000)
LONG_LENGTHS = (1_000, 10_000, 100_000, 1_000_000)
COMMON_MUTATIONS = (
    "wrong-type", "number-edge", "int64-overflow", "non-finite", "deep-nesting", "unknown-keys",
    "duplicate-key", "key-spelling", "key-escape", "invalid-utf8", "lone-surrogate",
    "control-char", "bad-escape", "trailing-data", "empty-body", "long-string", "img-tags",
    "bad-base64", "truncate", "whitespace", "null-member", "null-element",
)
MUTATIONS = {
    "score": (*COMMON_MUTATIONS, "limits"),
    "completions": (*COMMON_MUTATIONS, "key-fold"),  # /v1/score's own key matching: unknown
}
TYPICAL = {  # values a client sends, per Options field (the schema gives the type)
    "temperature": ("0", "0.0", "0.7", "1", "1.5"),
    "top_k": ("0", "1", "5", "40"),
    "top_p": ("0", "0.5", "0.9", "1"),
    "min_p": ("0", "0.05", "0.5"),
    "typical_p": ("0", "1"),
    "seed": ("-1", "0", "42", "123456789"),
    "num_predict": ("1", "2", "4", "8"),
    "repeat_last_n": ("-1", "0", "8", "64"),
    "repeat_penalty": ("0", "1", "1.1", "2"),
    "presence_penalty": ("0", "0.5", "-0.5"),
    "frequency_penalty": ("0", "0.5", "-0.5"),
    "num_ctx": ("0", "2048", "4096"),
}
# fmt: on


@dataclass
class Case:
    endpoint: str
    body: bytes
    tags: tuple[str, ...] = ()
    pad_to: int = 0  # > 0: the prompt is padded so the body is this long (sent lazily)

    def materialize(self) -> bytes:
        if not self.pad_to:
            return self.body
        marker = b"@@PAD@@"
        assert marker in self.body
        return self.body.replace(marker, b"x" * (self.pad_to - len(self.body) + len(marker)), 1)


def _choice(draw: Any, options: Any) -> Any:
    from hypothesis import strategies as st

    return draw(st.sampled_from(list(options)))


def _spelled(rnd: random.Random, key: str, endpoint: str) -> str:
    """Another spelling of `key` that the runner (and Go) must read as the same key."""
    options = [
        key,
        key.lower(),
        key.upper(),
        "".join(rnd.choice((c.lower(), c.upper())) for c in key),
    ]
    if endpoint == "score":
        bare = key.replace("_", "")
        options += [
            bare,
            bare.upper(),
            "_" + key,
            key + "_",
            key.replace("_", "__"),
            "Max" + bare[3:] if bare.startswith("max") else bare,
        ]
    return rnd.choice(options)


class Generator:
    """Bodies from docs/openapi.yaml's request schemas, mutated."""

    def __init__(
        self,
        api: OpenAPI | None = None,
        *,
        allow_oversize: bool = True,
        long_lengths: tuple[int, ...] = LONG_LENGTHS,
    ):
        self.api = api or openapi()
        self.allow_oversize = allow_oversize
        self.long_lengths = long_lengths
        self.options = self.api.schema("Options")["properties"]

    # base documents
    def _text(self, rnd: random.Random) -> str:
        return rnd.choice(PREFIXES) + rnd.choice(QUESTIONS)

    def score_doc(self, draw: Any, rnd: random.Random) -> Obj:
        from hypothesis import strategies as st

        row_schema = self.api.schema("ScoreRow")["properties"]
        req = self.api.schema("ScoreRequest")["properties"]
        rows_max = req["rows"]["maxItems"]
        cand_max = row_schema["candidates"]["maxItems"]
        n_rows = draw(st.one_of(st.integers(1, 4), st.integers(1, rows_max)))
        prefix = rnd.choice(PREFIXES)
        rows = []
        for _ in range(n_rows):
            n_cand = min(cand_max, rnd.choice((1, 2, 2, 3, 4, rnd.randint(1, cand_max))))
            cands = rnd.sample(CANDIDATES[:15], min(n_cand, 15))
            if rnd.random() < 0.1:
                cands.append(rnd.choice(CANDIDATES))
            prompt = prefix + rnd.choice(QUESTIONS) if rnd.random() < 0.8 else self._text(rnd)
            rows.append(
                Obj(
                    [
                        (Str(_spelled(rnd, "prompt", "score")), Str(prompt)),
                        (Str(_spelled(rnd, "candidates", "score")), Arr([Str(c) for c in cands])),
                    ]
                )
            )
        max_tokens = _choice(draw, ("64", "512", "2048", "128", "16", "1", "3"))
        pairs = [
            (Str(_spelled(rnd, "rows", "score")), Arr(rows)),
            (Str(_spelled(rnd, "max_tokens", "score")), Num(max_tokens)),
        ]
        rnd.shuffle(pairs)
        return Obj(pairs)

    def completions_doc(self, draw: Any, rnd: random.Random) -> Obj:
        pairs: list[tuple[Str, Any]] = [
            (Str(_spelled(rnd, "Prompt", "completions")), Str(self._text(rnd)))
        ]
        options = []
        for name in rnd.sample(sorted(self.options), rnd.randint(0, 6)):
            schema = self.options[name]
            kind = schema["type"]
            if name == "num_predict" or (name not in TYPICAL and kind in ("integer", "number")):
                value: Any = Num(rnd.choice(TYPICAL.get(name, ("0", "1", "4"))))
            elif name in TYPICAL:
                value = Num(rnd.choice(TYPICAL[name]))
            elif kind == "boolean":
                value = Lit(rnd.choice((b"true", b"false")))
            elif kind == "array":
                value = Arr(
                    [Str(rnd.choice(("\n", "Q:", "</s>", ""))) for _ in range(rnd.randint(0, 3))]
                )
            else:
                continue
            options.append((Str(_spelled(rnd, name, "completions")), value))
        # num_predict small unless a mutation says otherwise: a whole context takes seconds
        if not any(k.text.lower() == "num_predict" for k, _ in options):
            options.append((Str("num_predict"), Num(rnd.choice(TYPICAL["num_predict"]))))
        pairs.append((Str(_spelled(rnd, "Options", "completions")), Obj(options)))
        if rnd.random() < 0.3:
            pairs.append((Str(_spelled(rnd, "Logprobs", "completions")), Lit(b"true")))
            pairs.append(
                (
                    Str(_spelled(rnd, "TopLogprobs", "completions")),
                    Num(str(rnd.choice((0, 1, 5, 20)))),
                ),
            )
        rnd.shuffle(pairs)
        return Obj(pairs)

    # tokenize: raw text
    def tokenize_case(self, draw: Any, rnd: random.Random) -> Case:
        from hypothesis import strategies as st

        kind = _choice(
            draw,
            (
                "text",
                "unicode",
                "bytes",
                "invalid-utf8",
                "long-string",
                "empty-body",
                "special",
                "json",
            ),
        )
        if kind == "text":
            body = self._text(rnd).encode()
        elif kind == "unicode":
            body = draw(st.text(max_size=200)).encode("utf-8", "surrogatepass")
        elif kind == "bytes":
            body = draw(st.binary(max_size=300))
        elif kind == "invalid-utf8":
            text = self._text(rnd).encode()
            cut = rnd.randint(0, len(text))
            body = text[:cut] + rnd.choice(INVALID_UTF8) + text[cut:]
        elif kind == "long-string":
            body = (rnd.choice(QUESTIONS) + " ").encode() * (rnd.choice(self.long_lengths) // 16)
        elif kind == "empty-body":
            body = rnd.choice((b"", b" ", b"\n", b"\x00"))
        elif kind == "special":
            body = rnd.choice(
                ("<|im_end|>", "<|endoftext|>Is it?", "[img-0] Is it?", "<|im_start|>user")
            ).encode()
        else:
            body = rnd.choice((*EMPTY_BODIES, b'{"rows":[]}'))
        return Case("tokenize", body, (kind,))

    # mutations on the tree
    @staticmethod
    def _walk(node: Any, path: tuple = ()) -> Iterator[tuple[Any, Any, Any, tuple]]:
        """(container, index, child, path) for every value below `node`."""
        if isinstance(node, Obj):
            for i, (key, value) in enumerate(node.pairs):
                yield node, i, value, (*path, key.text.lower())
                yield from Generator._walk(value, (*path, key.text.lower()))
        elif isinstance(node, Arr):
            for i, value in enumerate(node.items):
                yield node, i, value, (*path, i)
                yield from Generator._walk(value, (*path, i))

    @staticmethod
    def _replace(container: Any, index: int, value: Any) -> None:
        if isinstance(container, Obj):
            container.pairs[index] = (container.pairs[index][0], value)
        else:
            container.items[index] = value

    def _random_value(self, rnd: random.Random, depth: int = 0) -> Any:
        kind = rnd.choice(
            ("str", "num", "lit", "arr", "obj") if depth < 3 else ("str", "num", "lit")
        )
        if kind == "str":
            return Str(rnd.choice(("", "x", "Is it?", "[img-0]", "\u00e9\U0001f600")))
        if kind == "num":
            return Num(rnd.choice(EDGE_NUMBERS))
        if kind == "lit":
            return Lit(rnd.choice((b"true", b"false", b"null")))
        if kind == "arr":
            return Arr([self._random_value(rnd, depth + 1) for _ in range(rnd.randint(0, 3))])
        return Obj(
            [
                (Str(rnd.choice(KEYS_UNKNOWN)), self._random_value(rnd, depth + 1))
                for _ in range(rnd.randint(0, 3))
            ]
        )

    def _insert_raw(self, rnd: random.Random, node: Str, insert: bytes) -> None:
        raw = node.raw if node.raw is not None else node.encode()[1:-1]
        cut = rnd.randint(0, len(raw))
        while cut and raw[cut - 1 : cut] == b"\\":  # never split an escape
            cut -= 1
        node.raw = raw[:cut] + insert + raw[cut:]

    def mutate(
        self, endpoint: str, doc: Obj, name: str, draw: Any, rnd: random.Random
    ) -> bytes | None:
        """Apply mutation `name` to `doc` in place; a whole body when it replaces the tree."""
        values = list(self._walk(doc))
        strings = [v for v in values if isinstance(v[2], Str)]
        numbers = [v for v in values if isinstance(v[2], Num)]
        objects = [doc] + [v[2] for v in values if isinstance(v[2], Obj)]
        arrays = [v[2] for v in values if isinstance(v[2], Arr)]
        if name == "wrong-type" and values:
            container, index, _, _ = rnd.choice(values)
            self._replace(container, index, self._random_value(rnd))
        elif name == "number-edge" and numbers:
            container, index, _, _ = rnd.choice(numbers)
            self._replace(container, index, Num(_choice(draw, EDGE_NUMBERS)))
        elif name == "int64-overflow":
            ints = [v for v in numbers if re.fullmatch(r"-?\d+", v[2].literal)] or numbers
            if ints:
                container, index, _, _ = rnd.choice(ints)
                self._replace(container, index, Num(_choice(draw, OVERFLOW_INTS)))
        elif name == "non-finite" and values:
            container, index, _, _ = rnd.choice(numbers or values)
            self._replace(container, index, Lit(_choice(draw, NON_FINITE)))
        elif name == "deep-nesting":
            depth = _choice(draw, DEEP_DEPTHS)
            style = rnd.choice(("arr", "obj", "mixed"))
            if style == "arr":
                nested = b"[" * depth + b"]" * depth
            elif style == "obj":
                nested = b'{"a":' * depth + b"1" + b"}" * depth
            else:
                nested = b'[{"a":' * (depth // 2) + b"null" + b"}]" * (depth // 2)
            target = rnd.choice(objects)
            target.pairs.insert(
                rnd.randint(0, len(target.pairs)), (Str(rnd.choice(KEYS_UNKNOWN)), Lit(nested))
            )
        elif name == "unknown-keys":
            for _ in range(rnd.randint(1, 4)):
                target = rnd.choice(objects)
                target.pairs.insert(
                    rnd.randint(0, len(target.pairs)),
                    (Str(rnd.choice(KEYS_UNKNOWN)), self._random_value(rnd)),
                )
        elif name == "duplicate-key":
            candidates = [o for o in objects if o.pairs]
            if candidates:
                target = rnd.choice(candidates)
                key, value = rnd.choice(target.pairs)
                again = rnd.choice(
                    (Lit(b"null"), copy.deepcopy(value), self._random_value(rnd), Arr([]), Obj([]))
                )
                spelling = Str(_spelled(rnd, key.text, endpoint))
                target.pairs.insert(rnd.randint(0, len(target.pairs)), (spelling, again))
        elif name == "key-spelling":
            candidates = [o for o in objects if o.pairs]
            if candidates:
                target = rnd.choice(candidates)
                i = rnd.randrange(len(target.pairs))
                key, value = target.pairs[i]
                target.pairs[i] = (Str(_spelled(rnd, key.text, endpoint)), value)
        elif name == "key-fold":  # Go folds ſ to s and K (Kelvin) to k; see go_fold
            candidates = [
                (o, i)
                for o in objects
                for i, (k, _) in enumerate(o.pairs)
                if re.search("[sSkK]", k.text)
            ]
            if candidates:
                target, i = rnd.choice(candidates)
                key, value = target.pairs[i]
                folded = (
                    re.sub("[sS]", "\u017f", key.text, count=1)
                    if rnd.random() < 0.5 or not re.search("[kK]", key.text)
                    else re.sub("[kK]", "\u212a", key.text, count=1)
                )
                target.pairs[i] = (Str(folded), value)
        elif name == "key-escape":
            candidates = [o for o in objects if o.pairs]
            if candidates:
                target = rnd.choice(candidates)
                i = rnd.randrange(len(target.pairs))
                key, value = target.pairs[i]
                raw = "".join(f"\\u{ord(c):04x}" if rnd.random() < 0.5 else c for c in key.text)
                target.pairs[i] = (Str(key.text, raw=raw.encode("utf-8", "surrogatepass")), value)
        elif name in ("invalid-utf8", "lone-surrogate", "control-char", "bad-escape"):
            targets = strings + [(None, None, k, ()) for o in objects for k, _ in o.pairs]
            if targets:
                pool = {
                    "invalid-utf8": INVALID_UTF8,
                    "lone-surrogate": SURROGATES,
                    "control-char": CONTROL,
                    "bad-escape": BAD_ESCAPES,
                }[name]
                self._insert_raw(rnd, rnd.choice(targets)[2], _choice(draw, pool))
        elif name == "long-string" and strings:
            length = _choice(draw, self.long_lengths)
            unit = rnd.choice(("x", " the", "Is the sky blue? ", "\u00e9", "\U0001f600", "[img-0]"))
            container, index, _, _ = rnd.choice(strings)
            self._replace(container, index, Str(unit * max(1, length // len(unit))))
        elif name == "img-tags":
            prompts = [v for v in strings if v[3] and v[3][-1] in ("prompt",)]
            for container, index, node, _ in prompts[: rnd.randint(1, 3)]:
                tag = f"[img-{rnd.choice(('0', '1', '-1', '99999999999999999999', 'x', ''))}]"
                self._replace(
                    container,
                    index,
                    Str(
                        rnd.choice((tag + node.text, node.text + tag, node.text + " " + tag + " ?"))
                    ),
                )
            if rnd.random() < 0.6:
                doc.pairs.append(self._media(endpoint, rnd, GOOD_BASE64))
        elif name == "bad-base64":
            doc.pairs.append(self._media(endpoint, rnd, BAD_BASE64))
        elif name == "null-member" and values:
            container, index, _, _ = rnd.choice(values)
            self._replace(container, index, Lit(b"null"))
        elif name == "null-element" and arrays:
            target = rnd.choice(arrays)
            target.items.insert(rnd.randint(0, len(target.items)), Lit(b"null"))
        elif name == "limits" and endpoint == "score":
            rows = [
                v[2] for v in values if isinstance(v[2], Arr) and v[3] and v[3][-1] in ("rows",)
            ]
            cands = [
                v[2] for v in values if isinstance(v[2], Arr) and v[3] and v[3][-1] == "candidates"
            ]
            if rows and (rnd.random() < 0.5 or not cands):
                n = _choice(draw, (0, 63, 64, 65, 100))
                rows[0].items = (
                    [copy.deepcopy(rows[0].items[i % max(1, len(rows[0].items))]) for i in range(n)]
                    if rows[0].items
                    else []
                )
            elif cands:
                n = _choice(draw, (0, 25, 26, 27, 40))
                cands[0].items = [Str(c) for c in (CANDIDATES * 3)[:n]]
        return None

    def _media(self, endpoint: str, rnd: random.Random, data: tuple[str, ...]) -> tuple[Str, Any]:
        items = []
        for _ in range(rnd.choice((0, 1, 1, 2))):
            item = [(Str("data"), Str(rnd.choice(data)))]
            if rnd.random() < 0.8:
                item.append(
                    (Str("id"), Num(rnd.choice(("0", "1", "-1", "7", "9223372036854775808"))))
                )
            if rnd.random() < 0.8:
                item.append((Str(rnd.choice(("Kind", "kind", "KIND"))), Str(rnd.choice(KINDS))))
            items.append(Obj(item))
        key = "media" if endpoint == "score" else "Media"
        return Str(_spelled(rnd, key, endpoint)), Arr(items)

    def case(self, draw: Any) -> Case:
        from hypothesis import strategies as st

        endpoint = _choice(draw, ("score",) * 9 + ("completions",) * 8 + ("tokenize",) * 3)
        # Bulk content comes from a seeded Random: Hypothesis draws structure and edge values
        # (its integers favour boundaries, so counts hit 1 and 64), the Random the text.
        rnd = random.Random(draw(st.integers(0, 2**64 - 1)))
        if endpoint == "tokenize":
            return self.tokenize_case(draw, rnd)
        doc = self.score_doc(draw, rnd) if endpoint == "score" else self.completions_doc(draw, rnd)
        count = _choice(draw, (0, 0, 1, 1, 1, 1, 2, 2, 3))
        names = [rnd.choice(MUTATIONS[endpoint]) for _ in range(count)]
        body_level = {"trailing-data", "empty-body", "truncate", "whitespace"}
        for name in names:
            if name not in body_level:
                self.mutate(endpoint, doc, name, draw, rnd)
        body = serialize(doc)
        for name in names:
            if name == "trailing-data":
                body += _choice(draw, TRAILING)
            elif name == "empty-body":
                body = _choice(draw, EMPTY_BODIES)
            elif name == "truncate" and body:
                body = body[: rnd.randrange(len(body))]
            elif name == "whitespace":
                ws = rnd.choice((b" ", b"\n", b"\t\r\n ", b"\xef\xbb\xbf", b"\x0c"))
                body = ws + body if rnd.random() < 0.5 else body + ws
        pad_to = 0
        if self.allow_oversize and rnd.random() < 0.001:  # over the 64 MiB limit
            names.append("oversize")
            pad_to = 64 * MIB + rnd.choice((1, 4096))
            key = "prompt" if endpoint == "score" else "Prompt"
            doc = (
                Obj([(Str(key), Str("@@PAD@@"))])
                if endpoint == "completions"
                else Obj(
                    [
                        (
                            Str("rows"),
                            Arr(
                                [
                                    Obj(
                                        [
                                            (Str(key), Str("@@PAD@@")),
                                            (Str("candidates"), Arr([Str(" Yes")])),
                                        ]
                                    )
                                ]
                            ),
                        ),
                        (Str("max_tokens"), Num("64")),
                    ]
                )
            )
            body = serialize(doc)
        return Case(endpoint, body, tuple(names) or ("valid",), pad_to)


def generate_cases(
    count: int,
    seed: int,
    *,
    allow_oversize: bool = True,
    long_lengths: tuple[int, ...] = LONG_LENGTHS,
) -> list[Case]:
    """`count` distinct cases drawn by Hypothesis from seed `seed` (the same list every time).

    Hypothesis runs only as a generator here (phase `generate`, no database, no shrinking):
    it revisits near-identical examples on purpose, so repeats are dropped and a few more
    examples than asked for are drawn."""
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as hypothesis_seed
    from hypothesis import strategies as st

    generator = Generator(allow_oversize=allow_oversize, long_lengths=long_lengths)
    cases: list[Case] = []
    seen: set[tuple[str, bytes, int]] = set()

    @st.composite
    def one(draw):
        return generator.case(draw)

    @hypothesis_seed(seed)
    @settings(
        max_examples=count * 3 // 2 + 20,
        database=None,
        phases=[Phase.generate],
        deadline=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(one())
    def collect(case: Case) -> None:
        key = (case.endpoint, case.body, case.pad_to)
        if key not in seen and len(cases) < count:
            seen.add(key)
            cases.append(case)

    collect()
    return cases
