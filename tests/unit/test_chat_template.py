"""Chat templates render as Hugging Face renders them, inside the sandbox, with clear errors."""

from __future__ import annotations

import datetime
from typing import Any

import pytest
from transformers.utils.chat_template_utils import render_jinja_template

from tokenmill_service.contract.chat.chat_template import CHATML_TEMPLATE, KNOWN_ROLES, ChatTemplate, ChatTemplateError
from tokenmill_service.contract.tokenizer import Tokenizer

CONVERSATIONS: list[list[dict[str, str]]] = [
    [{"role": "user", "content": "Hi!"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Why is the sky blue?"}],
    [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "  and 3+3?\n"},
    ],
    [{"role": "user", "content": "call a tool"}, {"role": "tool", "content": '{"result": 7}'}],
    [{"role": "user", "content": "ünïcödé 日本語 🚀 <b>&amp;</b> \"quotes\" 'single'"}],
]

# A template with the constructs real ones use: whitespace control, loop.first/last, namespace,
# tojson, trim, raise_exception, and block tags on their own lines (trim_blocks/lstrip_blocks).
RICH_TEMPLATE = """
{%- set ns = namespace(system='') %}
{% for message in messages %}
    {% if message['role'] == 'system' %}
        {% set ns.system = message['content'] | trim %}
    {% endif %}
{% endfor %}
{{ bos_token }}
{% if ns.system %}
[SYS] {{ ns.system }} [/SYS]
{% endif %}
{% for message in messages if message['role'] != 'system' %}
    {% if message['role'] not in ['user', 'assistant', 'tool'] %}
        {{ raise_exception('unexpected role ' + message['role']) }}
    {% endif %}
    <{{ message['role'] }}{% if loop.last %} last{% endif %}>{{ message['content'] | trim }}</{{ message['role'] }}>
    {{ message | tojson }}
{% endfor %}
{% if add_generation_prompt %}
<assistant>
{% endif %}
{{ eos_token if not add_generation_prompt else '' }}
"""


def _hf_render(template: str, messages: list[dict[str, str]], add_generation_prompt: bool, **kwargs: Any) -> str:
    rendered, _ = render_jinja_template(
        conversations=[messages], chat_template=template, add_generation_prompt=add_generation_prompt, **kwargs
    )
    return rendered[0]


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("messages", CONVERSATIONS, ids=lambda m: str(len(m)))
def test_smollm2_template_renders_like_transformers(
    default_tokenizer: Tokenizer, messages: list[dict[str, str]], add_generation_prompt: bool
) -> None:
    assert default_tokenizer.chat_template is not None
    ours = ChatTemplate(default_tokenizer.chat_template, bos_token="<|im_start|>", eos_token="<|im_end|>")
    expected = _hf_render(default_tokenizer.chat_template, messages, add_generation_prompt)
    assert ours.render(messages, add_generation_prompt) == expected


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("messages", CONVERSATIONS, ids=lambda m: str(len(m)))
def test_whitespace_control_tojson_and_namespace_render_like_transformers(
    messages: list[dict[str, str]], add_generation_prompt: bool
) -> None:
    ours = ChatTemplate(RICH_TEMPLATE, bos_token="<s>", eos_token="</s>")
    expected = _hf_render(RICH_TEMPLATE, messages, add_generation_prompt, bos_token="<s>", eos_token="</s>")
    assert ours.render(messages, add_generation_prompt) == expected


def test_tojson_does_not_html_escape() -> None:
    template = ChatTemplate("{{ messages[0]['content'] | tojson }}")
    assert template.render([{"role": "user", "content": "<a href='x'>&</a> é"}]) == "\"<a href='x'>&</a> é\""


def test_tojson_takes_indent_like_json_dumps() -> None:
    template = ChatTemplate("{{ messages[0] | tojson(indent=2) }}")
    assert template.render([{"role": "user", "content": "x"}]) == '{\n  "role": "user",\n  "content": "x"\n}'


def test_raise_exception_becomes_a_value_error_with_the_templates_message() -> None:
    template = ChatTemplate("{{ raise_exception('System role not supported') }}")
    with pytest.raises(ValueError, match="System role not supported"):
        template.render([{"role": "system", "content": "x"}])


def test_strftime_now_formats_the_current_date() -> None:
    template = ChatTemplate("{{ strftime_now('%Y') }}")
    assert template.render([{"role": "user", "content": "x"}]) in {
        str(datetime.datetime.now().year),
        str(datetime.datetime.now().year - 1),
    }


def test_bos_and_eos_token_are_template_variables() -> None:
    template = ChatTemplate("{{ bos_token }}|{{ eos_token }}", bos_token="<s>", eos_token="</s>")
    assert template.render([{"role": "user", "content": "x"}]) == "<s>|</s>"


def test_generation_tag_and_loop_controls_render() -> None:
    source = (
        "{% for m in messages %}{% if loop.index > 2 %}{% break %}{% endif %}"
        "{% generation %}[{{ m['content'] }}]{% endgeneration %}{% endfor %}"
    )
    messages = [{"role": "user", "content": str(i)} for i in range(4)]
    assert ChatTemplate(source).render(messages) == "[0][1]"


def test_a_template_that_does_not_compile_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="does not compile"):
        ChatTemplate("{% for m in messages %}{{ m }")


@pytest.mark.parametrize(
    "source",
    [
        "{{ messages[0].nothing.deeper }}",
        "{{ messages.append(1) }}",
        "{{ ''.__class__.__mro__[1].__subclasses__() }}",
        "{{ messages[0]['content'] + 1 }}",
    ],
    ids=["undefined", "mutation", "escape-attempt", "type-error"],
)
def test_template_failures_and_sandbox_violations_are_value_errors(source: str) -> None:
    with pytest.raises(ChatTemplateError):
        ChatTemplate(source).render([{"role": "user", "content": "x"}])


def test_missing_template_falls_back_to_chatml() -> None:
    template = ChatTemplate(None)
    assert template.source == CHATML_TEMPLATE and template.is_default
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
    assert (
        template.render(messages)
        == "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\n"
    )
    assert template.render(messages, add_generation_prompt=False).endswith("U<|im_end|>\n")


def test_unknown_role_is_rejected_naming_the_role() -> None:
    template = ChatTemplate(None)
    assert KNOWN_ROLES == {"system", "user", "assistant", "tool"}
    with pytest.raises(ValueError, match="'narrator'"):
        template.render([{"role": "user", "content": "a"}, {"role": "narrator", "content": "b"}])


def test_roles_a_template_compares_against_are_accepted() -> None:
    template = ChatTemplate(
        "{% for m in messages %}{% if m['role'] == 'ipython' %}py:{% endif %}{{ m.content }}{% endfor %}"
    )
    assert "ipython" in template.roles
    assert template.render([{"role": "ipython", "content": "out"}]) == "py:out"


@pytest.mark.parametrize(
    "message",
    [{"content": "no role"}, {"role": "user"}, {"role": "user", "content": None}],
    ids=["no-role", "no-content", "none-content"],
)
def test_malformed_message_is_a_value_error(message: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match="message 0"):
        ChatTemplate(None).render([message])
