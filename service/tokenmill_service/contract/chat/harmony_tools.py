"""Tool calling in the harmony format (gpt-oss): the tools offered, the history's calls and results as
harmony messages, and the grammar that forces a call.

- Offered: the tools become harmony function tools (``ToolDescription``) in the developer message, which
  openai-harmony renders as a TypeScript-like ``namespace functions``; the system message then tells the
  model that calls go to the commentary channel.
- History: an assistant message's call is a commentary message to ``functions.NAME`` whose content type is
  ``<|constrain|>json`` and whose text is the arguments (before it, the message's reasoning as an analysis
  message and its content as a commentary preamble); a tool message is a message from ``functions.NAME`` to the assistant, the name found
  by its ``tool_call_id`` among the earlier calls (or its ``name``).
- Forced (tool_choice "required" or a function): a Lark grammar (llguidance's, with harmony's control tokens
  as ``<|name|>``) admitting an optional analysis message, then one call of an allowed tool whose arguments
  are valid against its schema, ended by ``<|call|>`` (a constrained answer's shape, harmony_constraint.py).
  A harmony turn holds one call (``<|call|>`` ends it), so ``parallel_tool_calls`` changes nothing here.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from tokenmill_service.contract.chat.harmony_constraint import ANALYSIS_RULES
from tokenmill_service.contract.chat.tool_calls import TOOL_NAME, X_GUIDANCE, Tool
from tokenmill_service.contract.closed_schema import close_schema

NAMESPACE = "functions"  # harmony.CALL_PREFIX without its dot
JSON_CONTENT_TYPE = "<|constrain|>json"


def function_tools(tools: Sequence[Mapping[str, Any]]) -> list[Any]:
    """OpenAI-shaped tools (``{"type": "function", "function": {...}}``) as harmony tool descriptions."""
    import openai_harmony as oh

    out = []
    for tool in tools:
        fn = tool["function"]
        out.append(oh.ToolDescription.new(fn["name"], fn.get("description") or "", parameters=fn.get("parameters")))
    return out


def call_messages(message: Mapping[str, Any], names: dict[str, str], index: int) -> list[Any]:
    """An assistant message with ``tool_calls`` as harmony messages (its reasoning first, as an analysis
    message, then its content, as a preamble);
    each call's id is noted in ``names`` with its function's name, for the tool messages answering it."""
    import openai_harmony as oh

    out = []
    reasoning = str(message.get("reasoning_content") or "")
    if reasoning:  # the analysis that led to the calls, which the model sees again until its final answer
        out.append(oh.Message.from_role_and_content(oh.Role.ASSISTANT, reasoning).with_channel("analysis"))
    content = str(message.get("content") or "")
    if content:
        out.append(oh.Message.from_role_and_content(oh.Role.ASSISTANT, content).with_channel("commentary"))
    for j, call in enumerate(message["tool_calls"]):
        fn = call["function"]
        _check_name(fn["name"], f"message {index} (assistant): tool_calls[{j}]'s")
        arguments = fn.get("arguments")
        text = arguments if isinstance(arguments, str) else json.dumps(arguments if arguments is not None else {})
        out.append(
            oh.Message.from_role_and_content(oh.Role.ASSISTANT, text or "{}")
            .with_channel("commentary")
            .with_recipient(f"{NAMESPACE}.{fn['name']}")
            .with_content_type(JSON_CONTENT_TYPE)
        )
        if call.get("id"):
            names[str(call["id"])] = fn["name"]
    return out


def result_message(message: Mapping[str, Any], names: Mapping[str, str], index: int) -> Any:
    """A tool message as harmony's message from ``functions.NAME`` to the assistant."""
    import openai_harmony as oh

    name = names.get(str(message.get("tool_call_id") or "")) or message.get("name")
    if not name:
        raise ValueError(
            f"message {index} (tool) answers no earlier call: give the tool_call_id of an assistant message's "
            "call, or the tool's name"
        )
    _check_name(str(name), f"message {index} (tool):")
    author = oh.Author.new(oh.Role.TOOL, f"{NAMESPACE}.{name}")
    content = str(message.get("content") or "")
    return oh.Message.from_author_and_content(author, content).with_channel("commentary").with_recipient("assistant")


def _check_name(name: str, where: str) -> None:
    # The name goes into a message's header (to=functions.NAME): a space or a dot there would change it.
    if not TOOL_NAME.fullmatch(name):
        raise ValueError(f"{where} function name must be 1 to 64 letters, digits, '_' or '-'; given {name!r}")


def call_grammar(tools: Sequence[Tool], permissive: bool = False) -> str:
    """A Lark grammar admitting what a harmony answer that must call one of ``tools`` may be: an optional
    analysis message, then ``<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>`` with
    arguments valid against NAME's schema (closed unless ``permissive``: contract/closed_schema.py), and
    ``<|call|>``."""
    calls = []
    for t in tools:
        arguments = json.loads(json.dumps(t.parameters)) if t.parameters else {"type": "object", "properties": {}}
        schema = {**(arguments if permissive else close_schema(arguments)), "x-guidance": X_GUIDANCE}
        header = json.dumps(f"commentary to={NAMESPACE}.{t.name} ")
        calls.append(f'<|channel|> {header} <|constrain|> "json" <|message|> %json {json.dumps(schema)} <|call|>')
    return "start: analysis? call\n" + ANALYSIS_RULES + f"call: {' | '.join(calls)}\n"
