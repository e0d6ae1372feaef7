"""The router renders chat templates without transformers (router/chat_template.py); here each rendering is
held to transformers' own, for the packaged model's template and for templates that use what real ones use:
tools through ``tojson``, special tokens, ``raise_exception``, loop controls, ``{% generation %}`` blocks,
a conversation continued from its final message."""

from __future__ import annotations

import json

import pytest
from transformers.utils.chat_template_utils import render_jinja_template

from pdserve.router.chat_template import ChatTemplate, TemplateError

SPECIAL = {"bos_token": "<s>", "eos_token": "</s>"}

TOOLS_TEMPLATE = (
    "{{ bos_token }}{% if tools %}<tools>{% for t in tools %}{{ t | tojson(indent=2) }}\n{% endfor %}</tools>{% endif %}"
    "{% for m in messages %}{% if m.role == 'system' and not loop.first %}{{ raise_exception('system first') }}"
    "{% endif %}{% if m.role == 'skip' %}{% continue %}{% endif %}<|{{ m.role }}|>\n"
    "{% if m.role == 'assistant' %}{% generation %}{{ m.content }}{{ eos_token }}{% endgeneration %}"
    "{% else %}{{ m.content }}{% endif %}\n{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
LIST_TEMPLATE = ("{% for m in messages %}[{{ m.role }}]{% for p in m.content %}{{ p.text }}{% endfor %}[/]"
                 "{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}")
CONVERSATION = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"},
                {"role": "skip", "content": "x"}, {"role": "assistant", "content": "Sunny, 21 °C. "}]
TOOLS = [{"type": "function", "function": {"name": "weather", "description": "Météo",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]


def theirs(template: str, messages, **kw) -> str:
    rendered, _ = render_jinja_template([messages], chat_template=template, **kw)
    return rendered[0]


@pytest.mark.parametrize("kw", [
    {"add_generation_prompt": True},
    {"add_generation_prompt": False, "tools": TOOLS},
    {"continue_final_message": True},
], ids=["generation-prompt", "tools", "continue"])
def test_a_template_renders_as_transformers_renders_it(kw):
    mine = ChatTemplate(TOOLS_TEMPLATE, SPECIAL).render(CONVERSATION, **{"add_generation_prompt": False, **kw})
    assert mine == theirs(TOOLS_TEMPLATE, CONVERSATION, **{**SPECIAL, **kw})
    if kw.get("continue_final_message"):
        assert mine.endswith("Sunny, 21 °C. ")  # the continued message is open: no eos, no newline


def test_list_contents_continue_from_their_last_text():
    msgs = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b "}]}]
    mine = ChatTemplate(LIST_TEMPLATE, {}).render(msgs, add_generation_prompt=False, continue_final_message=True)
    assert mine == theirs(LIST_TEMPLATE, msgs, continue_final_message=True) == "[user]ab "


def test_the_packaged_models_template_and_tokens(packaged_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(packaged_model_dir))
    mine = ChatTemplate.load(str(packaged_model_dir))
    for msgs in (CONVERSATION[:2], CONVERSATION[1:2], [*CONVERSATION[:2], CONVERSATION[3], CONVERSATION[1]]):
        for gen in (True, False):
            assert mine.render(msgs, add_generation_prompt=gen) == \
                tok.apply_chat_template(msgs, add_generation_prompt=gen, tokenize=False)


def test_a_template_that_refuses_a_conversation_raises_and_one_cannot_reach_python():
    t = ChatTemplate(TOOLS_TEMPLATE, SPECIAL)
    with pytest.raises(TemplateError, match="system first"):
        t.render([{"role": "user", "content": "a"}, {"role": "system", "content": "b"}])
    from jinja2.exceptions import SecurityError

    sneaky = ChatTemplate("{{ ''.__class__.__mro__[1].__subclasses__() }}", {})
    with pytest.raises(SecurityError):
        sneaky.render([])


def test_templates_come_from_the_model_directory(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": {"content": "<s>", "lstrip": False}, "eos_token": "</s>",
        "chat_template": [{"name": "default", "template": "D{{ bos_token }}"},
                          {"name": "tool_use", "template": "T{{ eos_token }}"}]}))
    t = ChatTemplate.load(str(tmp_path))
    assert t.render([]) == "D<s>"
    assert t.render([], tools=TOOLS) == "T</s>"
    (tmp_path / "chat_template.jinja").write_text("J")  # a template file wins, as in transformers
    assert ChatTemplate.load(str(tmp_path)).render([]) == "J"
    with pytest.raises(ValueError, match="no chat template"):
        ChatTemplate.load(str(tmp_path / "missing"))


@pytest.fixture(scope="module")
def packaged_model_dir():
    from pdserve.model.resolve import resolve_model

    return resolve_model(None)
