"""A GenerateRequest's tools, checked: the tools offered, the chat history with calls and their results, and
the grammar that forces a call when tool_choice asks for one (see tool_calls.py for the formats)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from tokenmill_service.contract.chat import harmony_tools
from tokenmill_service.contract.chat.tool_calls import (
    TOOL_NAME,
    Tool,
    ToolFamily,
    call_grammar,
    call_text,
    family_for,
    tools_prompt,
)
from tokenmill_service.contract.grammar_finite import unproductive_refs
from tokenmill_service.contract.request import Constraint
from tokenmill_service.contract.tokenizer import Tokenizer
from tokenmill_service.front.proto import pb

MAX_TOOLS = 128


class ToolError(ValueError):
    def __init__(self, message: str, field: str) -> None:
        super().__init__(message)
        self.field = field


def tools_in_use(request: pb.GenerateRequest) -> bool:
    """Whether calls are offered and read back from the answer."""
    return bool(request.tools) and request.tool_choice != pb.TOOL_CHOICE_NONE


def family(tokenizer: Tokenizer) -> ToolFamily:
    return family_for(tokenizer.chat_template)


def parse_tools(request: pb.GenerateRequest) -> list[Tool]:
    if len(request.tools) > MAX_TOOLS:
        raise ToolError(f"tools holds {len(request.tools)} tools; at most {MAX_TOOLS} are allowed", "tools")
    if request.tools and request.WhichOneof("input") != "chat":
        raise ToolError("tools need chat input (the chat template offers them)", "tools")
    tools: list[Tool] = []
    for i, t in enumerate(request.tools):
        if not TOOL_NAME.fullmatch(t.name):
            raise ToolError(f"tools[{i}].name must be 1 to 64 letters, digits, '_' or '-'; given {t.name!r}", "tools")
        if any(other.name == t.name for other in tools):
            raise ToolError(f"tools[{i}].name {t.name!r} is given twice", "tools")
        # OpenAI's reading: a function given no parameters takes none.
        parameters: Any = {"type": "object", "properties": {}}
        if t.parameters:
            try:
                parameters = json.loads(t.parameters)
            except json.JSONDecodeError as exc:
                raise ToolError(f"tools[{i}].parameters is not valid JSON: {exc}", "tools") from None
            except RecursionError:
                raise ToolError(f"tools[{i}].parameters is nested too deeply", "tools") from None
            if not isinstance(parameters, dict):
                raise ToolError(f"tools[{i}].parameters must be a JSON schema object", "tools")
            if unproductive_refs(parameters) is not None:
                # (A call could never be completed: its grammar would run until max_new_tokens.)
                raise ToolError(
                    f"tools[{i}].parameters admits no finite value: every value would have to hold another", "tools"
                )
        tools.append(Tool(t.name, t.description, parameters))
    if request.tool_choice == pb.TOOL_CHOICE_FUNCTION and not any(
        t.name == request.tool_choice_function for t in tools
    ):
        raise ToolError(
            f"tool_choice_function {request.tool_choice_function!r} is not one of the tools", "tool_choice_function"
        )
    if request.tool_choice in (pb.TOOL_CHOICE_REQUIRED, pb.TOOL_CHOICE_FUNCTION) and not tools:
        raise ToolError("tool_choice asks for a call but no tools are given", "tool_choice")
    return tools


def tool_constraint(
    request: pb.GenerateRequest, tools: Sequence[Tool], tokenizer: Tokenizer, permissive: bool = False
) -> Constraint | None:
    """The grammar that forces a call (tool_choice required or a function); None when the model decides.
    A named function is called exactly once, as OpenAI's API does; required makes one or more calls unless
    parallel_tool_calls is false. ``permissive``: the arguments' schemas read as JSON Schema reads them
    (contract/closed_schema.py)."""
    if request.tool_choice == pb.TOOL_CHOICE_REQUIRED:
        allowed = list(tools)
        parallel = not request.HasField("parallel_tool_calls") or request.parallel_tool_calls
    elif request.tool_choice == pb.TOOL_CHOICE_FUNCTION:
        allowed = [t for t in tools if t.name == request.tool_choice_function]
        parallel = False
    else:
        return None
    if tokenizer.harmony:  # one call per turn: <|call|> ends it
        return Constraint("grammar", harmony_tools.call_grammar(allowed, permissive), "lark")
    return Constraint("grammar", call_grammar(allowed, family(tokenizer), parallel, permissive), "lark")


def chat_with_tools(
    chat: pb.Messages, tools: Sequence[Tool], tokenizer: Tokenizer
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """The messages as the chat template takes them, and the tools to pass it (None: offered in a system
    message, or not at all). Calls in assistant messages go in their content, in the model's own syntax,
    unless the template renders ``tool_calls``."""
    template = tokenizer.chat
    fam = family(tokenizer)
    # A harmony model's conversation is rendered by openai-harmony, tools and calls included (harmony.py).
    structured = tokenizer.harmony
    messages: list[dict[str, Any]] = []
    for m in chat.messages:
        message: dict[str, Any] = {"role": m.role, "content": m.content}
        if m.tool_calls:
            if structured or template.renders_tool_calls:
                # harmony writes the arguments' JSON text as the caller gave it (the model's own, as a rule).
                message["tool_calls"] = [
                    {
                        "id": c.id,
                        "type": "function",
                        "function": {"name": c.name, "arguments": c.arguments if structured else _arguments(c)},
                    }
                    for c in m.tool_calls
                ]
            else:
                calls = fam.separator.join(call_text(c.name, c.arguments or "{}", fam) for c in m.tool_calls)
                message["content"] = f"{m.content}\n{calls}" if m.content else calls
        if m.tool_call_id:
            message["tool_call_id"] = m.tool_call_id
        if m.reasoning and structured:
            message["reasoning_content"] = m.reasoning
        if m.name:
            message["name"] = m.name
        messages.append(message)
    if not tools:
        return messages, None
    if structured or template.renders_tools:
        return messages, [t.openai_json() for t in tools]
    offer = tools_prompt(list(tools), fam)
    if messages and messages[0]["role"] == "system":
        messages[0] = {**messages[0], "content": f"{messages[0]['content']}\n\n{offer}"}
    else:
        messages.insert(0, {"role": "system", "content": offer})
    return messages, None


def _arguments(call: pb.ToolCall) -> Any:
    try:
        return json.loads(call.arguments or "{}")
    except (json.JSONDecodeError, RecursionError):  # (given as text: the template shows it as it is)
        return call.arguments
