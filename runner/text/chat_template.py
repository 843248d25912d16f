"""A model's chat template, rendered as transformers renders it (`apply_chat_template`).

The template is the model's own: `chat_template.jinja` beside the tokenizer when there is
one (transformers 5 reads it first), else `chat_template` in tokenizer_config.json (a
string, or a list of named templates: the one named "default"). It is rendered as
transformers' `render_jinja_template` does: Jinja's `ImmutableSandboxedEnvironment` with
`trim_blocks` and `lstrip_blocks`, the `loopcontrols` extension and a no-op `generation`
block, `tojson` without HTML escaping, `raise_exception`, `strftime_now`, a restricted
`dict` and `namespace`; the variables are `messages`, `tools`, `documents`,
`add_generation_prompt` and the tokenizer's special tokens as strings (`bos_token`,
`eos_token`, ...). Messages are plain JSON (keys whose value is null dropped, as
transformers drops them), with `reasoning_content` / `thinking` aliased as it aliases them.
An error inside the template (`raise_exception`, an undefined operation) is a
`ChatTemplateError`, which the faces answer as a 400.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

from runner.text.tokenizer import token_text

SPECIAL_TOKENS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class ChatTemplateError(ValueError):
    """The template refused the conversation, or failed while rendering it."""


class _Generation(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` renders its body (transformers' assistant
    tracker, which only records where the body lies)."""

    tags = {"generation"}  # noqa: RUF012 (Jinja's own declaration)

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


class _TemplateDict:
    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _Namespace(jinja2.utils.Namespace):
    """Jinja's namespace, refusing underscore attributes (as transformers')."""

    def __init__(*args: Any, **kwargs: Any) -> None:
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"chat templates cannot store underscore-prefixed attributes, got {name!r}"
            )


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _Namespace
    return env


def template_source(tokenizer_config: dict[str, Any] | None, jinja_file: str | None) -> str | None:
    """The template's text: `chat_template.jinja`'s, else tokenizer_config.json's."""
    if jinja_file:
        return jinja_file
    value = (tokenizer_config or {}).get("chat_template")
    if isinstance(value, str) and value:
        return value
    if isinstance(value, list):  # [{"name": ..., "template": ...}]: the default one
        for item in value:
            if isinstance(item, dict) and item.get("name") == "default":
                template = item.get("template")
                return template if isinstance(template, str) else None
    return None


def _plain(value: Any) -> Any:
    """JSON data only (what transformers' `_plain_template_data` keeps)."""
    if value is None or isinstance(value, str | bool | int | float):
        return value
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return f"<{type(value).__name__}>"


def _message(message: dict[str, Any]) -> dict[str, Any]:
    plain = {k: _plain(v) for k, v in message.items() if v is not None}
    reasoning = next((plain[k] for k in _REASONING_FIELDS if plain.get(k) is not None), None)
    if reasoning is not None:
        plain = {"thinking": reasoning, **plain, "reasoning_content": reasoning}
    return plain


class ChatTemplate:
    """One model's template, compiled once; `render` is thread-safe."""

    def __init__(self, source: str, tokenizer_config: dict[str, Any] | None = None):
        self.source = source
        try:
            self._template = _environment().from_string(source)
        except jinja2.exceptions.TemplateError as e:
            raise ChatTemplateError(f"the model's chat template does not compile: {e}") from None
        config = tokenizer_config or {}
        texts = {key: token_text(config.get(key)) for key in SPECIAL_TOKENS}
        self.special = {key: text for key, text in texts.items() if text is not None}

    def render(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[Any] | None = None,
        documents: list[Any] | None = None,
        **extra: Any,
    ) -> str:
        """The conversation as the prompt text transformers' `apply_chat_template(...,
        tokenize=False)` returns; raises ChatTemplateError."""
        try:
            return self._template.render(
                messages=[_message(m) for m in messages],
                tools=_plain(tools),
                documents=_plain(documents),
                add_generation_prompt=add_generation_prompt,
                **{**self.special, **{k: _plain(v) for k, v in extra.items()}},
            )
        except (jinja2.exceptions.TemplateError, TypeError, ValueError, KeyError) as e:
            raise ChatTemplateError(f"chat template: {e}") from None
        except RecursionError:
            raise ChatTemplateError("chat template: too deeply nested") from None
