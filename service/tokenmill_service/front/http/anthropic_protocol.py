"""Anthropic's Messages API (`POST /v1/messages`, `POST /v1/messages/count_tokens`), served through the chat path.

A Messages body is rewritten as the chat completions body it means and read by openai_protocol's parse_request,
so it takes the same chat template, tools, constraint, sampling and validation as /v1/chat/completions; the
answer is the chat answer reshaped (builder: MessagesBuilder): content blocks (text, tool_use), stop_reason,
usage, and a stream's named events (message_start, content_block_start / _delta / _stop, message_delta,
message_stop). Errors take Anthropic's shape, ``{"type": "error", "error": {"type", "message"}}``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from tokenmill_service.front.http.dialect import Dialect, given, parse_as_chat
from tokenmill_service.front.http.openai_protocol import ParsedRequest
from tokenmill_service.front.http.openai_response import ResponseBuilder
from tokenmill_service.front.http.request_fields import BadRequest, check_model, json_object, text_of
from tokenmill_service.front.proto import pb

# The GenerateRequest's field paths as this API names them (what refusals say).
_FIELDS = {
    "stopping.stop": "stop_sequences",
    "json_schema": "output_config.format",
    "json_object": "output_config.format",
}
# parse_request's parameter names for what this API calls otherwise.
_PARAMS = {
    "stop": "stop_sequences",
    "response_format.json_schema": "output_config.format",
    "response_format": "output_config.format",
}

STOP_REASONS = {
    pb.FINISH_REASON_EOS: "end_turn",
    pb.FINISH_REASON_STOP_SEQUENCE: "stop_sequence",
    pb.FINISH_REASON_LENGTH: "max_tokens",
    pb.FINISH_REASON_CONTEXT_LIMIT: "model_context_window_exceeded",
    pb.FINISH_REASON_TOOL_CALLS: "tool_use",
}

# HTTP status -> Anthropic's error type.
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    409: "conflict_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    504: "timeout_error",
}
OTHER_ERROR = "api_error"  # (any other status: a 500, a bug of ours)


def _turn(m: Any, i: int) -> list[dict[str, Any]]:
    """One Messages turn as chat messages: a user turn's tool_result blocks each become a tool message (before
    its text), an assistant turn's tool_use blocks its tool_calls."""
    where = f"messages[{i}]"
    if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
        raise BadRequest(f"{where} must be an object with 'role' 'user' or 'assistant'", "messages")
    role, content = m["role"], m.get("content")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise BadRequest(f"{where}.content must be a string or a list of content blocks", "messages")
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    results: list[dict[str, Any]] = []
    for j, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        at = f"{where}.content[{j}]"
        if kind == "text":
            if not isinstance(block.get("text"), str):
                raise BadRequest(f"{at} (text) needs a 'text' string", "messages")
            texts.append(block["text"])
        elif kind == "tool_use" and role == "assistant":
            if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str):
                raise BadRequest(f"{at} (tool_use) needs an 'id' and a 'name'", "messages")
            arguments = block.get("input", {})
            if not isinstance(arguments, dict):
                raise BadRequest(f"{at}.input must be an object", "messages")
            function = {"name": block["name"], "arguments": json.dumps(arguments, ensure_ascii=False)}
            calls.append({"id": block["id"], "type": "function", "function": function})
        elif kind == "tool_result" and role == "user":
            if not isinstance(block.get("tool_use_id"), str):
                raise BadRequest(f"{at} (tool_result) needs a 'tool_use_id'", "messages")
            result = text_of(block.get("content", ""), f"{at}.content", "messages", "block", "\n\n")
            results.append({"role": "tool", "tool_call_id": block["tool_use_id"], "content": result})
        elif kind in ("thinking", "redacted_thinking") and role == "assistant":
            continue  # an earlier answer's reasoning: not shown to the model again
        else:
            allowed = "text and tool_use" if role == "assistant" else "text and tool_result"
            raise BadRequest(
                f"{at}: a block of type {kind!r} is not supported in a {role} turn ({allowed})", "messages"
            )
    if role == "assistant":
        return [{"role": "assistant", "content": "\n\n".join(texts), **({"tool_calls": calls} if calls else {})}]
    return [*results, *([{"role": "user", "content": "\n\n".join(texts)}] if texts or not results else [])]


def _tools(value: Any) -> list[dict[str, Any]]:
    if not isinstance(value, list):
        raise BadRequest("'tools' must be a list of {'name', 'description', 'input_schema'}", "tools")
    tools = []
    for i, tool in enumerate(value):
        if not isinstance(tool, dict) or not isinstance(tool.get("name"), str):
            raise BadRequest(f"tools[{i}] must be an object with a 'name'", "tools")
        if tool.get("type") not in (None, "custom"):
            raise BadRequest(
                f"tools[{i}]: tools of type {tool['type']!r} (run by Anthropic's servers) are not supported; "
                "give client tools ({'name', 'description', 'input_schema'})",
                "tools",
                "unsupported_value",
            )
        schema = tool.get("input_schema")
        if not isinstance(schema, dict):
            raise BadRequest(f"tools[{i}].input_schema must be a JSON schema object", "tools")
        description = tool.get("description", "")
        if not isinstance(description, str):
            raise BadRequest(f"tools[{i}].description must be a string", "tools")
        tools.append(
            {"type": "function", "function": {"name": tool["name"], "description": description, "parameters": schema}}
        )
    return tools


def _tool_choice(value: Any, chat: dict[str, Any]) -> None:
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "auto":
        chat["tool_choice"] = "auto"
    elif kind == "any":
        chat["tool_choice"] = "required"
    elif kind == "none":
        chat["tool_choice"] = "none"
    elif kind == "tool" and isinstance(value.get("name"), str):
        chat["tool_choice"] = {"type": "function", "function": {"name": value["name"]}}
    else:
        raise BadRequest(
            "'tool_choice' must be {'type': 'auto'}, {'type': 'any'}, {'type': 'none'} or {'type': 'tool', 'name': ...}",
            "tool_choice",
        )
    disable = value.get("disable_parallel_tool_use")
    if disable is not None:
        if not isinstance(disable, bool):
            raise BadRequest("'tool_choice.disable_parallel_tool_use' must be true or false", "tool_choice")
        chat["parallel_tool_calls"] = not disable


def _output_format(value: Any) -> dict[str, Any]:
    """output_config.format, Anthropic's structured output: {"type": "json_schema", "schema": {...}}."""
    if not isinstance(value, dict) or value.get("type") != "json_schema" or not isinstance(value.get("schema"), dict):
        raise BadRequest(
            "'output_config.format' must be {'type': 'json_schema', 'schema': {...}}", "output_config.format"
        )
    return {"type": "json_schema", "json_schema": {"name": "response", "schema": value["schema"]}}


def chat_body(body: Any, count_only: bool = False) -> dict[str, Any]:
    """The chat completions body a Messages body means (``count_only``: count_tokens', only what makes the prompt:
    no max_tokens, stop_sequences, sampling or stream)."""
    body = json_object(body)
    check_model(body)
    chat: dict[str, Any] = {"model": body.get("model")}
    if not count_only:
        max_tokens = body.get("max_tokens")
        if max_tokens is None:
            raise BadRequest("'max_tokens' is required", "max_tokens", "missing_required_parameter")
        chat["max_tokens"] = max_tokens  # (checked as the chat path checks it)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty list of {'role', 'content'} objects", "messages")
    system = "" if body.get("system") is None else text_of(body["system"], "'system'", "system", "block", "\n\n")
    turns = [{"role": "system", "content": system}] if system else []
    for i, m in enumerate(messages):
        turns += _turn(m, i)
    chat["messages"] = turns
    if not count_only:  # (what shapes the answer, not the prompt: count_tokens takes none of it, as Anthropic's)
        stop = body.get("stop_sequences")
        if stop is not None:
            if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
                raise BadRequest("'stop_sequences' must be a list of strings", "stop_sequences")
            chat["stop"] = stop
        chat.update(given(body, "temperature", "top_p", "top_k", "stream"))
    if body.get("tools") is not None:
        chat["tools"] = _tools(body["tools"])
    if body.get("tool_choice") is not None:
        _tool_choice(body["tool_choice"], chat)
    config = body.get("output_config")
    if config is not None:
        if not isinstance(config, dict):
            raise BadRequest("'output_config' must be an object", "output_config")
        if config.get("format") is not None:
            chat["response_format"] = _output_format(config["format"])
    # Anthropic's default temperature is 1, as OpenAI's; `thinking`, `metadata` and `service_tier` change nothing
    # a server without extended thinking does and are ignored.
    return chat


def parse_messages(body: Any, count_only: bool = False) -> ParsedRequest:
    return parse_as_chat(lambda: chat_body(body, count_only), _PARAMS, _FIELDS)


def count_tokens_json(prompt_tokens: int) -> dict[str, Any]:
    return {"input_tokens": prompt_tokens}


def error_body(status: int, body: dict[str, Any]) -> dict[str, Any]:
    """OpenAI's error JSON (openai_errors.error_json) in Anthropic's shape."""
    kind = ERROR_TYPES.get(status, OTHER_ERROR)
    return {"type": "error", "error": {"type": kind, "message": body["error"]["message"]}}


def _tool_input(arguments: str) -> dict[str, Any]:
    """A call's arguments as tool_use's input object (an object, always: {} where the model wrote none)."""
    try:
        value = json.loads(arguments)
    except json.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}


def _matched_stop(stops: Sequence[str], text: str, tokens_text: str) -> str | None:
    """Which stop sequence ended the text: the generated tokens run past the text into it."""
    rest = tokens_text.removeprefix(text)
    found = [(rest.find(s), -len(s), s) for s in stops if s in rest]
    return min(found)[2] if found else (stops[0] if stops else None)


class MessagesBuilder(ResponseBuilder):
    """The chat answer as a Messages answer: whole, or as the stream's events (one content block at a time: the
    text, then each tool_use)."""

    STREAM_END = b""
    NAMED_EVENTS = True

    def __init__(self, parsed: ParsedRequest, request_id: str, model: str, echo_texts: Sequence[str] = ()) -> None:
        super().__init__(parsed, request_id, model, echo_texts)
        self.id = "msg_" + request_id
        self.blocks = 0  # content blocks started
        self.text_open = False
        self.text = ""  # what was streamed, and the generated tokens' text (for the stop sequence matched)
        self.tokens_text = ""

    def _stop(self, last: pb.GenerateResponse, text: str, tokens_text: str) -> tuple[str, str | None]:
        reason = STOP_REASONS.get(last.finish_reason, "end_turn")
        if reason != "stop_sequence":
            return reason, None
        return reason, _matched_stop(self.parsed.request.stopping.stop, text, tokens_text)

    def whole(self, results: Sequence[Sequence[pb.GenerateResponse]]) -> dict[str, Any]:
        answer = super().whole(results)
        message = answer["choices"][0]["message"]
        content: list[dict[str, Any]] = []
        if message["content"]:
            content.append({"type": "text", "text": message["content"]})
        for call in message.get("tool_calls") or []:
            function = call["function"]
            tool_input = _tool_input(function["arguments"])
            content.append({"type": "tool_use", "id": call["id"], "name": function["name"], "input": tool_input})
        responses = results[0]
        text = "".join(r.text for r in responses)
        tokens_text = "".join(t.text for r in responses for t in r.tokens if not t.special)
        stop_reason, stop_sequence = self._stop(responses[-1], text, tokens_text)
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": content,
            "stop_reason": stop_reason,
            "stop_sequence": stop_sequence,
            "usage": {
                "input_tokens": answer["usage"]["prompt_tokens"],
                "output_tokens": answer["usage"]["completion_tokens"],
            },
        }

    def first_chunks(self) -> list[dict[str, Any]]:
        # The prompt's length comes with the last response: message_delta's usage carries it.
        message: dict[str, Any] = {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": 0, "output_tokens": 0},
        }
        return [{"type": "message_start", "message": message}]

    def _block(self, block: dict[str, Any], delta: dict[str, Any]) -> list[dict[str, Any]]:
        """A whole content block as its start, one delta and its stop."""
        index = self.blocks
        self.blocks += 1
        return [
            {"type": "content_block_start", "index": index, "content_block": block},
            {"type": "content_block_delta", "index": index, "delta": delta},
            {"type": "content_block_stop", "index": index},
        ]

    def events(self, response: pb.GenerateResponse) -> list[dict[str, Any]]:
        self.text += response.text
        self.tokens_text += "".join(t.text for t in response.tokens if not t.special)
        chunk = self.chunk(response)  # the text held back from where a call starts; the calls at the end
        if chunk is None:
            return []
        choice = chunk["choices"][0]
        text = choice["delta"].get("content") or ""
        events: list[dict[str, Any]] = []
        if text:
            if not self.text_open:
                self.text_open = True
                opened = {"type": "text", "text": ""}
                events.append({"type": "content_block_start", "index": self.blocks, "content_block": opened})
            delta = {"type": "text_delta", "text": text}
            events.append({"type": "content_block_delta", "index": self.blocks, "delta": delta})
        if choice["finish_reason"] is None:
            return events
        if self.text_open:
            events.append({"type": "content_block_stop", "index": self.blocks})
            self.blocks += 1
        for call in choice["delta"].get("tool_calls") or []:
            function = call["function"]
            block: dict[str, Any] = {"type": "tool_use", "id": call["id"], "name": function["name"], "input": {}}
            arguments = json.dumps(_tool_input(function["arguments"]), ensure_ascii=False)
            events += self._block(block, {"type": "input_json_delta", "partial_json": arguments})
        stop_reason, stop_sequence = self._stop(response, self.text, self.tokens_text)
        usage = {"input_tokens": self.usage.prompt_tokens, "output_tokens": self.usage.completion_tokens}
        events.append(
            {
                "type": "message_delta",
                "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                "usage": usage,
            }
        )
        return [*events, {"type": "message_stop"}]

    @staticmethod
    def error_body(status: int, body: dict[str, Any]) -> dict[str, Any]:
        return error_body(status, body)

    def error_event(self, status: int, body: dict[str, Any]) -> dict[str, Any]:
        return error_body(status, body)


MESSAGES = Dialect(parse_messages, MessagesBuilder, key_header="x-api-key")
