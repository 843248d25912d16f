"""Chat templates (runner/text/chat_template.py) render as transformers' apply_chat_template."""

from __future__ import annotations

import json

import pytest

from runner.text.chat_template import ChatTemplate, ChatTemplateError, template_source
from tests.tiny import TOKENIZER_CONFIG, tokenizer_json

CHATML = (
    "{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# namespace, loop controls, tojson, tools, raise_exception and trimmed blocks
RICH = """
{%- set ns = namespace(system=none) -%}
{%- for m in messages -%}
  {%- if m.role == 'system' -%}{%- set ns.system = m.content -%}{%- continue -%}{%- endif -%}
  {%- if m.role not in ['user', 'assistant'] -%}
    {{ raise_exception('bad role ' + m.role) }}{%- endif -%}
  [{{ m.role | upper }}] {% if ns.system %}({{ ns.system }}) {% endif %}
  {%- if m.content is string %}{{ m.content }}{% else %}{% for p in m.content %}
    {%- if p.type == 'image' %}<start_of_image>{% else %}{{ p.text }}{% endif %}
{% endfor %}{% endif %}
{% endfor -%}
{%- if tools %}TOOLS {{ tools | tojson }}{% endif -%}
{%- if add_generation_prompt %}[ASSISTANT] {% endif -%}
"""
CONVERSATIONS = [
    [{"role": "user", "content": "Is the sky blue?"}],
    [
        {"role": "system", "content": "Be brief. «ünïcode»"},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello", "tool_calls": None},
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What?"}]},
    ],
]


def test_template_source_prefers_the_jinja_file():
    assert template_source({"chat_template": "a"}, "b") == "b"
    assert template_source({"chat_template": "a"}, None) == "a"
    named = [{"name": "tool_use", "template": "t"}, {"name": "default", "template": "d"}]
    assert template_source({"chat_template": named}, None) == "d"
    assert template_source({}, None) is None


def test_errors_are_chat_template_errors():
    with pytest.raises(ChatTemplateError, match="bad role"):
        ChatTemplate(RICH).render([{"role": "tool", "content": "x"}])
    with pytest.raises(ChatTemplateError):
        ChatTemplate("{% for %}")
    with pytest.raises(ChatTemplateError):  # the sandbox holds
        ChatTemplate("{{ messages.__class__.__mro__ }}{{ ''.__class__.__subclasses__() }}").render(
            []
        )


@pytest.mark.reference
@pytest.mark.parametrize("template", [CHATML, RICH])
@pytest.mark.parametrize("conversation", CONVERSATIONS)
@pytest.mark.parametrize("generation", [True, False])
def test_renders_as_transformers(tmp_path, reference_libraries, template, conversation, generation):
    from transformers import AutoTokenizer

    (tmp_path / "tokenizer.json").write_text(tokenizer_json())
    config = {**TOKENIZER_CONFIG, "chat_template": template}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    reference = AutoTokenizer.from_pretrained(str(tmp_path))
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    for extra in ({}, {"tools": tools}):
        expected = reference.apply_chat_template(
            conversation, tokenize=False, add_generation_prompt=generation, **extra
        )
        mine = ChatTemplate(template, config).render(conversation, generation, **extra)
        assert mine == expected
