"""The OpenAI API's tool calling, both ways: ``tools`` / ``tool_choice`` / ``parallel_tool_calls`` and the
history's assistant ``tool_calls`` and ``tool`` messages into a GenerateRequest, and the calls read from the
answer back into OpenAI's shapes (a whole message's ``tool_calls``, or a stream's deltas)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from tokenmill_service.contract.chat.tool_calls import TOOL_NAME
from tokenmill_service.front.proto import pb


class ToolParamError(ValueError):
    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def apply_tools(body: dict[str, Any], request: pb.GenerateRequest) -> None:
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise ToolParamError("'tools' must be a list of {'type': 'function', 'function': {...}}", "tools")
        for i, tool in enumerate(tools):
            fn = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                raise ToolParamError(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ...}}}}", "tools")
            parameters = fn.get("parameters")
            if parameters is not None and not isinstance(parameters, dict):
                raise ToolParamError(f"tools[{i}].function.parameters must be a JSON schema object", "tools")
            if not TOOL_NAME.fullmatch(fn["name"]):
                raise ToolParamError(
                    f"tools[{i}].function.name must be 1 to 64 letters, digits, '_' or '-'; given {fn['name']!r}",
                    "tools",
                )
            if fn.get("description") is not None and not isinstance(fn["description"], str):
                raise ToolParamError(f"tools[{i}].function.description must be a string", "tools")
            request.tools.add(
                name=fn["name"],
                description=fn.get("description") or "",
                parameters=json.dumps(parameters) if parameters is not None else "",
            )
    choice = body.get("tool_choice")
    if choice in (None, "auto"):
        request.tool_choice = pb.TOOL_CHOICE_AUTO
    elif choice == "none":
        request.tool_choice = pb.TOOL_CHOICE_NONE
    elif choice == "required":
        request.tool_choice = pb.TOOL_CHOICE_REQUIRED
    elif (
        isinstance(choice, dict)
        and isinstance(choice.get("function"), dict)
        and isinstance(choice["function"].get("name"), str)
    ):
        request.tool_choice = pb.TOOL_CHOICE_FUNCTION
        request.tool_choice_function = choice["function"]["name"]
    else:
        raise ToolParamError(
            "'tool_choice' must be 'none', 'auto', 'required' or {'type': 'function', 'function': {'name': ...}}",
            "tool_choice",
        )
    if request.tool_choice != pb.TOOL_CHOICE_AUTO and not request.tools and choice != "none":
        raise ToolParamError("'tool_choice' asks for a call but no 'tools' are given", "tool_choice")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None:
        if not isinstance(parallel, bool):
            raise ToolParamError("'parallel_tool_calls' must be true or false", "parallel_tool_calls")
        request.parallel_tool_calls = parallel


def message_tool_fields(m: dict[str, Any], message: pb.ChatMessage, where: str) -> None:
    """An assistant message's ``tool_calls`` and reasoning, a tool message's ``tool_call_id`` and ``name``."""
    calls = m.get("tool_calls")
    if calls is not None:
        if not isinstance(calls, list):
            raise ToolParamError(f"{where}.tool_calls must be a list", "messages")
        for j, call in enumerate(calls):
            fn = call.get("function") if isinstance(call, dict) else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                raise ToolParamError(f"{where}.tool_calls[{j}] must have a 'function' with a 'name'", "messages")
            arguments = fn.get("arguments") or "{}"
            if not isinstance(arguments, str):
                arguments = json.dumps(arguments)
            message.tool_calls.add(id=str(call.get("id") or ""), name=fn["name"], arguments=arguments)
    # The reasoning of an earlier answer is ``reasoning_content``, as it came back (vLLM's ``reasoning``).
    for key in ("tool_call_id", "name", "reasoning", "reasoning_content"):
        value = m.get(key)
        if value is not None and not isinstance(value, str):
            raise ToolParamError(f"{where}.{key} must be a string", "messages")
    message.tool_call_id = m.get("tool_call_id") or ""
    message.name = m.get("name") or ""
    message.reasoning = m.get("reasoning_content") or m.get("reasoning") or ""


def tool_calls_json(calls: Sequence[pb.ToolCall], delta: bool = False) -> list[dict[str, Any]]:
    out = []
    for i, c in enumerate(calls):
        one: dict[str, Any] = {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
        if delta:
            one = {"index": i, **one}
        out.append(one)
    return out
