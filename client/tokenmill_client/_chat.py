"""A conversation's value types: chat messages, the tools a model may call and its calls of them."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, TypeAlias


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One call of a tool, as the model made it (and as an assistant message of the history carries it)."""

    id: str
    """Unique within the conversation ("call_..."); the "tool" message answering it gives this id."""
    name: str
    """The function called."""
    arguments: str
    """Its arguments: a JSON object, as text."""

    def parsed_arguments(self) -> Any:
        """The arguments decoded (json.JSONDecodeError when the text is not JSON)."""
        return json.loads(self.arguments)


@dataclass(frozen=True, slots=True)
class Tool:
    """A function the model may call (chat requests only).

    ``parameters`` is the JSON Schema of its arguments object (a mapping, or its JSON text; None = any
    object). ``Tool.from_openai()`` reads OpenAI's ``{"type": "function", "function": {...}}`` shape.
    """

    name: str
    """Letters, digits, '_' and '-', at most 64 characters."""
    description: str = ""
    """What it does, for the model."""
    parameters: str | Mapping[str, Any] | None = field(default=None, hash=False, compare=False)
    """The arguments' JSON Schema; kept as JSON text (``parameters_json``)."""
    parameters_json: str = field(default="", init=False)

    def __post_init__(self) -> None:
        if self.parameters is None:
            text = ""
        elif isinstance(self.parameters, str):
            text = self.parameters
        else:
            text = json.dumps(self.parameters)
        object.__setattr__(self, "parameters_json", text)

    @classmethod
    def from_openai(cls, tool: Mapping[str, Any]) -> Tool:
        """A tool from OpenAI's shape ``{"type": "function", "function": {"name", "description", "parameters"}}``
        (or the bare function object); ValueError names what is missing."""
        if not isinstance(tool, Mapping):
            raise TypeError(f"a tool must be a mapping, got {type(tool).__name__}")
        if tool.get("type", "function") != "function":
            raise ValueError(f"only function tools are supported, got type {tool.get('type')!r}")
        function = tool.get("function", tool)
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
            raise TypeError("a tool needs a function with a string 'name'")
        description = function.get("description") or ""
        parameters = function.get("parameters")
        if not isinstance(description, str) or not (parameters is None or isinstance(parameters, (str, Mapping))):
            raise ValueError(f"tool {function['name']!r}: description must be a string, parameters an object")
        return cls(function["name"], description, parameters)


@dataclass(frozen=True, slots=True)
class FunctionChoice:
    """``tool_choice``: the answer is a call of this function (one of the tools)."""

    name: str


ToolChoice: TypeAlias = Literal["auto", "none", "required"] | FunctionChoice
"""Whether the model may ("auto"), must not ("none") or must ("required") call a tool, or must call one
function (FunctionChoice)."""

ToolLike: TypeAlias = Tool | Mapping[str, Any]
"""A tool as a Tool or as OpenAI's ``{"type": "function", "function": {...}}`` mapping."""


def to_tool(tool: ToolLike) -> Tool:
    return tool if isinstance(tool, Tool) else Tool.from_openai(tool)


@dataclass(frozen=True, slots=True)
class ChatMessage:
    """One turn of a conversation: role is "system", "user", "assistant" or "tool".

    An assistant turn that called tools carries them in ``tool_calls`` (its content may be empty); a
    "tool" turn holds a call's result in ``content``, with the call's id in ``tool_call_id``.
    """

    role: str
    content: str
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str = ""
    name: str = ""
    """A "tool" message: the name of the tool that answered (optional)."""
    reasoning: str = ""
    """An assistant message: its reasoning (a harmony model sees it again before the calls it made)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "tool_calls", tuple(self.tool_calls))


MessageLike: TypeAlias = ChatMessage | tuple[str, str] | Mapping[str, Any]
"""A chat turn as a ChatMessage, a (role, content) tuple or an OpenAI-style mapping: ``{"role": ...,
"content": ...}``, with ``tool_calls`` (OpenAI's ``{"id", "type": "function", "function": {"name",
"arguments"}}`` or ToolCalls) on an assistant turn and ``tool_call_id`` on a "tool" turn."""


def _tool_call(call: ToolCall | Mapping[str, Any]) -> ToolCall:
    if isinstance(call, ToolCall):
        return call
    if not isinstance(call, Mapping):
        raise TypeError(f"a tool call must be a ToolCall or a mapping, got {call!r}")
    function = call.get("function", call)
    name, arguments = function.get("name"), function.get("arguments", "{}")
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments)
    call_id = call.get("id", "")
    if not isinstance(name, str) or not isinstance(call_id, str):
        raise TypeError(f"a tool call needs a string function name and id, got {call!r}")
    return ToolCall(call_id, name, arguments)


def to_chat_message(message: MessageLike) -> ChatMessage:
    """Normalise one MessageLike into a ChatMessage (ValueError/TypeError for anything else)."""
    if isinstance(message, ChatMessage):
        return message
    calls: tuple[ToolCall, ...] = ()
    role: object
    content: object
    tool_call_id: object = ""
    name: object = ""
    reasoning: object = ""
    if isinstance(message, tuple):
        if len(message) != 2:
            raise ValueError(f"a chat message tuple must be (role, content), got {len(message)} items")
        role, content = message
    elif isinstance(message, Mapping):
        try:
            role = message["role"]
        except KeyError as exc:
            raise ValueError(f"a chat message mapping needs 'role' and 'content', missing {exc}") from None
        raw_calls = message.get("tool_calls") or ()
        calls = tuple(_tool_call(c) for c in raw_calls)
        if "content" not in message and not calls:
            raise ValueError("a chat message mapping needs 'role' and 'content', missing 'content'")
        content = message.get("content")
        if content is None and calls:  # OpenAI's assistant turn that only calls tools
            content = ""
        tool_call_id, name = message.get("tool_call_id") or "", message.get("name") or ""
        reasoning = message.get("reasoning_content") or message.get("reasoning") or ""
    else:
        raise TypeError(f"a chat message must be a ChatMessage, a (role, content) tuple or a mapping, got {message!r}")
    if not isinstance(role, str) or not isinstance(content, str):
        raise TypeError("a chat message's role and content must be strings")
    if not isinstance(tool_call_id, str) or not isinstance(name, str) or not isinstance(reasoning, str):
        raise TypeError("a chat message's tool_call_id, name and reasoning_content must be strings")
    return ChatMessage(role, content, calls, tool_call_id, name, reasoning)


def to_chat_messages(messages: Sequence[MessageLike]) -> tuple[ChatMessage, ...]:
    """Normalise a conversation; a bare string is rejected (it would be taken as characters)."""
    if isinstance(messages, (str, bytes)):
        raise TypeError("messages must be a sequence of chat messages, not a string")
    return tuple(to_chat_message(m) for m in messages)
