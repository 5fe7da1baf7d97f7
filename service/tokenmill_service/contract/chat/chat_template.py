"""Render a model's Jinja chat template the way Hugging Face ``apply_chat_template`` does.

Templates ship inside model files, so they are untrusted code: they run in Jinja's immutable
sandbox. The environment mirrors transformers' (``trim_blocks``, ``lstrip_blocks``, loop controls,
``raise_exception``, a non-HTML-escaping ``tojson``, ``strftime_now``) so a template renders here
byte for byte as it does there.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
import jinja2.runtime
from jinja2.sandbox import ImmutableSandboxedEnvironment

# Hugging Face's historical default for models that ship no template.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

KNOWN_ROLES: frozenset[str] = frozenset({"system", "user", "assistant", "tool"})

# Roles a template names in a comparison (`message['role'] == 'ipython'`, `role != "developer"`)
# are roles it was written to handle, beyond the common four.
_ROLE_IN_TEMPLATE = re.compile(r"""role['"]?\]?\s*[!=]=\s*['"]([A-Za-z_][\w-]*)['"]""")


class ChatTemplateError(ValueError):
    """The template does not compile, or rejects (or fails on) this conversation."""


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` marks assistant text for training masks; render the body as is."""

    tags = {"generation"}  # noqa: RUF012 - jinja declares it a plain set attribute

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render_body"), [], [], body).set_lineno(lineno)

    def _render_body(self, caller: jinja2.runtime.Macro) -> str:
        return str(caller())


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's own tojson HTML-escapes '<', '>', '&' and "'", which would change the prompt.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


class ChatTemplate:
    """One compiled chat template plus the special-token strings it may refer to."""

    def __init__(self, source: str | None = None, *, bos_token: str | None = None, eos_token: str | None = None):
        self.source = source if source is not None else CHATML_TEMPLATE
        self.is_default = source is None
        self.bos_token = bos_token or ""
        self.eos_token = eos_token or ""
        self.roles: frozenset[str] = KNOWN_ROLES | frozenset(_ROLE_IN_TEMPLATE.findall(self.source))
        try:
            self._template = _environment().from_string(self.source)
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"the chat template does not compile: {exc}") from exc

    def validate_messages(self, messages: Sequence[Mapping[str, Any]]) -> None:
        """Raise ``ChatTemplateError`` for a message without string role/content or with a role the template refuses."""
        for i, message in enumerate(messages):
            role = message.get("role")
            if not isinstance(role, str):
                raise ChatTemplateError(f"message {i} has no string 'role'")
            if role not in self.roles:
                allowed = ", ".join(sorted(self.roles))
                raise ChatTemplateError(
                    f"message {i} has role {role!r}, which the chat template does not accept ({allowed})"
                )
            if not isinstance(message.get("content"), str):
                raise ChatTemplateError(f"message {i} ({role}) has no string 'content'")

    @property
    def renders_tools(self) -> bool:
        """Whether the template renders a ``tools`` list (else the caller offers tools some other way)."""
        return "tools" in self.source

    @property
    def renders_tool_calls(self) -> bool:
        """Whether the template renders assistant messages' ``tool_calls`` (else they go in the content)."""
        return "tool_calls" in self.source

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> str:
        self.validate_messages(messages)
        extra: dict[str, Any] = {} if tools is None else {"tools": [dict(t) for t in tools]}
        try:
            return self._template.render(
                messages=[dict(m) for m in messages],
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
                **extra,
            )
        except jinja2.TemplateError as exc:
            # raise_exception() lands here too: its message is the template's own explanation.
            raise ChatTemplateError(f"the chat template rejected the conversation: {exc}") from exc
        except (TypeError, KeyError, IndexError, AttributeError) as exc:
            raise ChatTemplateError(f"the chat template failed on this conversation: {exc!r}") from exc
