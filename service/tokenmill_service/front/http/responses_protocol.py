"""OpenAI's Responses API (`POST /v1/responses`), served through the chat path, without server-side state.

A Responses body is rewritten as the chat completions body it means and read by openai_protocol's
parse_request, so it takes the same chat template, tools, constraint, sampling and validation as
/v1/chat/completions; the answer is the chat answer reshaped (builder: ResponsesBuilder): a response object
whose output holds a message item (output_text) and function_call items, and a stream's named events, each
with its sequence_number. Nothing is stored: ``previous_response_id`` (and ``conversation``) are refused,
the whole conversation comes in ``input`` (``store: false`` is what every answer says). Errors keep OpenAI's
shape.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tokenmill_service.front.http.dialect import Dialect, given, parse_as_chat
from tokenmill_service.front.http.openai_protocol import ParsedRequest
from tokenmill_service.front.http.openai_response import ResponseBuilder
from tokenmill_service.front.http.request_fields import BadRequest, check_model, json_object
from tokenmill_service.front.proto import pb

# The GenerateRequest's field paths as this API names them (what refusals say).
_FIELDS = {
    "stopping.max_new_tokens": "max_output_tokens",
    "chat.messages": "input",
    "json_schema": "text.format",
    "json_object": "text.format",
}
# parse_request's parameter names for what this API calls otherwise.
_PARAMS = {
    "messages": "input",
    "max_tokens": "max_output_tokens",
    "response_format.json_schema": "text.format",
    "response_format": "text.format",
}
_NO_STATE = "this server keeps no responses (as with store: false); send the whole conversation in 'input'"
# Parameters that ask for what tokenmill cannot do: refused unless absent (or this value, which asks nothing).
REFUSED: dict[str, tuple[Any, str]] = {
    "previous_response_id": (None, _NO_STATE),
    "conversation": (None, _NO_STATE),
    "background": (False, "responses are answered in the request that asks for them"),
    "prompt": (None, "this server keeps no prompt templates; send the prompt in 'instructions' and 'input'"),
    "top_logprobs": (0, "logprobs are served by /v1/chat/completions"),
}
_INCOMPLETE = (pb.FINISH_REASON_LENGTH, pb.FINISH_REASON_CONTEXT_LIMIT)


def _text(value: Any, where: str) -> str:
    """A message's content: a string, or a list of text parts (input_text; output_text in an earlier answer)."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise BadRequest(f"{where} must be a string or a list of input_text parts", "input")
    texts = []
    for i, part in enumerate(value):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text") and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif kind == "refusal" and isinstance(part.get("refusal"), str):
            texts.append(part["refusal"])
        else:
            raise BadRequest(
                f"{where}[{i}]: a part of type {kind!r} is not supported (input_text parts; this is a text model)",
                "input",
            )
    return "".join(texts)


def _string(item: dict[str, Any], name: str, where: str) -> str:
    value = item.get(name)
    if not isinstance(value, str):
        raise BadRequest(f"{where}.{name} must be a string", "input")
    return value


def _input(value: Any) -> list[dict[str, Any]]:
    """``input`` as chat messages: message items as turns, function_call items as the calls of an assistant turn
    (the one just before, when there is one), function_call_output items as tool turns."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise BadRequest("'input' must be a string or a non-empty list of items", "input")
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(value):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise BadRequest(f"{where} must be an object", "input")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise BadRequest(f"{where}.role must be 'user', 'assistant', 'system' or 'developer'", "input")
            content = _text(item.get("content"), f"{where}.content")
            messages.append({"role": "system" if role == "developer" else role, "content": content})
        elif kind == "function_call":
            call_id, name = _string(item, "call_id", where), _string(item, "name", where)
            call = {
                "id": call_id,
                "type": "function",
                "function": {"name": name, "arguments": _string(item, "arguments", where)},
            }
            if messages and messages[-1]["role"] == "assistant":
                messages[-1].setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            output = _text(item.get("output"), f"{where}.output")
            messages.append({"role": "tool", "tool_call_id": _string(item, "call_id", where), "content": output})
        elif kind == "reasoning":
            continue  # an earlier answer's reasoning: not shown to the model again
        elif kind == "item_reference":
            raise BadRequest(
                f"{where}: an item_reference needs stored items; {_NO_STATE}", "input", "unsupported_value"
            )
        else:
            raise BadRequest(
                f"{where}: items of type {kind!r} are not supported (message, function_call, function_call_output)",
                "input",
                "unsupported_value",
            )
    return messages


def _tools(value: Any) -> list[dict[str, Any]]:
    if not isinstance(value, list):
        raise BadRequest("'tools' must be a list of {'type': 'function', 'name', 'parameters'}", "tools")
    tools = []
    for i, tool in enumerate(value):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            if isinstance(kind, str):
                raise BadRequest(
                    f"tools[{i}]: tools of type {kind!r} (run by OpenAI's servers) are not supported; give function tools",
                    "tools",
                    "unsupported_value",
                )
            raise BadRequest(f"tools[{i}] must be {{'type': 'function', 'name': ..., 'parameters': {{...}}}}", "tools")
        if not isinstance(tool.get("name"), str):
            raise BadRequest(f"tools[{i}].name must be a string", "tools")
        parameters = tool.get("parameters")
        if parameters is not None and not isinstance(parameters, dict):
            raise BadRequest(f"tools[{i}].parameters must be a JSON schema object", "tools")
        description = tool.get("description")
        if description is not None and not isinstance(description, str):
            raise BadRequest(f"tools[{i}].description must be a string", "tools")
        function = {"name": tool["name"], "description": description or "", "parameters": parameters}
        tools.append({"type": "function", "function": function})
    return tools


def _tool_choice(value: Any) -> Any:
    if value in ("auto", "none", "required"):
        return value
    if isinstance(value, dict) and value.get("type") == "function" and isinstance(value.get("name"), str):
        return {"type": "function", "function": {"name": value["name"]}}
    raise BadRequest(
        "'tool_choice' must be 'auto', 'none', 'required' or {'type': 'function', 'name': ...}", "tool_choice"
    )


def _response_format(text: Any) -> dict[str, Any] | None:
    """text.format as the chat API's response_format (None: plain text)."""
    if not isinstance(text, dict):
        raise BadRequest("'text' must be an object ({'format': {...}})", "text")
    spec = text.get("format")
    if spec is None:
        return None
    kind = spec.get("type") if isinstance(spec, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        if spec.get("schema") is None:
            raise BadRequest("'text.format' of type json_schema needs a 'schema'", "text.format")
        described = {k: spec[k] for k in ("name", "description", "schema", "strict") if spec.get(k) is not None}
        return {"type": "json_schema", "json_schema": described}
    raise BadRequest(
        f"'text.format.type' must be 'text', 'json_object' or 'json_schema'; given {kind!r}", "text.format"
    )


def chat_body(body: Any) -> dict[str, Any]:
    """The chat completions body a Responses body means."""
    body = json_object(body)
    for name, (neutral, why) in REFUSED.items():
        value = body.get(name)
        if value is not None and not (type(value) is type(neutral) and value == neutral):
            raise BadRequest(f"'{name}' is not supported: {why}", name, "unsupported_parameter")
    check_model(body)
    if body.get("input") is None:
        raise BadRequest("'input' is required: a string or a list of items", "input", "missing_required_parameter")
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise BadRequest("'instructions' must be a string", "instructions")
    system = [{"role": "system", "content": instructions}] if instructions else []
    messages = [*system, *_input(body["input"])]
    if not messages:
        raise BadRequest("'input' holds no message: reasoning items alone are no prompt", "input")
    chat: dict[str, Any] = {"model": body.get("model"), "messages": messages}
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    chat.update(given(body, "temperature", "top_p", "stream", "parallel_tool_calls"))
    if body.get("tools") is not None:
        chat["tools"] = _tools(body["tools"])
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = _tool_choice(body["tool_choice"])
    if body.get("text") is not None and (response_format := _response_format(body["text"])) is not None:
        chat["response_format"] = response_format
    metadata = body.get("metadata")
    if metadata is not None and not isinstance(metadata, dict):  # (changes nothing, but the answer repeats it)
        raise BadRequest(f"'metadata' must be an object; given {metadata!r}", "metadata")
    # store, include, reasoning, truncation, user and the like change nothing this server does: ignored.
    return chat


def _echoed(body: dict[str, Any], parsed: ParsedRequest) -> dict[str, Any]:
    """The request's parameters, as a response repeats them."""
    text = body.get("text") or {}
    return {
        "instructions": body.get("instructions"),
        "max_output_tokens": parsed.request.stopping.max_new_tokens or None,  # (as read: 3, where 3.0 was sent)
        "temperature": 1.0 if body.get("temperature") is None else body["temperature"],
        "top_p": 1.0 if body.get("top_p") is None else body["top_p"],
        "tools": body.get("tools") or [],
        "tool_choice": body.get("tool_choice") or "auto",
        "parallel_tool_calls": body.get("parallel_tool_calls") is not False,
        "text": {"format": text.get("format") or {"type": "text"}},
        "metadata": body.get("metadata") or {},
    }


def parse_responses(body: Any) -> ParsedRequest:
    parsed = parse_as_chat(lambda: chat_body(body), _PARAMS, _FIELDS)
    parsed.echoed = _echoed(body, parsed)
    return parsed


class ResponsesBuilder(ResponseBuilder):
    """The chat answer as a response object: whole, or as the stream's events (the message item, then each
    function_call item)."""

    STREAM_END = b""
    NAMED_EVENTS = True

    def __init__(self, parsed: ParsedRequest, request_id: str, model: str, echo_texts: Sequence[str] = ()) -> None:
        super().__init__(parsed, request_id, model, echo_texts)
        self.id = "resp_" + request_id
        self.message_id = "msg_" + request_id
        self.sequence = 0  # the next event's sequence_number
        self.output: list[dict[str, Any]] = []  # the stream's items done
        self.text = ""  # the stream's message text so far
        self.message_open = False

    def _response(
        self, status: str, output: list[dict[str, Any]], usage: dict[str, int] | None, incomplete: bool = False
    ) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "model": self.model,
            "output": output,
            "previous_response_id": None,
            "store": False,
            "truncation": "disabled",
            **self.parsed.echoed,
            "usage": None
            if usage is None
            else {
                "input_tokens": usage["prompt_tokens"],
                "input_tokens_details": {"cached_tokens": 0},
                "output_tokens": usage["completion_tokens"],
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": usage["prompt_tokens"] + usage["completion_tokens"],
            },
        }

    def _message(self, text: str, status: str) -> dict[str, Any]:
        part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
        return {
            "type": "message",
            "id": self.message_id,
            "status": status,
            "role": "assistant",
            "content": [part] if status != "in_progress" else [],
        }

    @staticmethod
    def _call(call: dict[str, Any], status: str = "completed") -> dict[str, Any]:
        function = call["function"]
        arguments = function["arguments"] if status == "completed" else ""
        return {
            "type": "function_call",
            "id": "fc_" + call["id"].removeprefix("call_"),
            "call_id": call["id"],
            "name": function["name"],
            "arguments": arguments,
            "status": status,
        }

    def whole(self, results: Sequence[Sequence[pb.GenerateResponse]]) -> dict[str, Any]:
        answer = super().whole(results)
        message = answer["choices"][0]["message"]
        incomplete = results[0][-1].finish_reason in _INCOMPLETE
        calls = message.get("tool_calls") or []
        output = [self._message(message["content"] or "", "incomplete" if incomplete else "completed")]
        if calls and not message["content"]:
            output = []
        output += [self._call(call) for call in calls]
        return self._response("incomplete" if incomplete else "completed", output, answer["usage"], incomplete)

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return event

    def first_chunks(self) -> list[dict[str, Any]]:
        return [
            self._event("response.created", response=self._response("in_progress", [], None)),
            self._event("response.in_progress", response=self._response("in_progress", [], None)),
        ]

    def _open_message(self) -> list[dict[str, Any]]:
        self.message_open = True
        index = len(self.output)
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        return [
            self._event("response.output_item.added", output_index=index, item=self._message("", "in_progress")),
            self._event(
                "response.content_part.added", item_id=self.message_id, output_index=index, content_index=0, part=part
            ),
        ]

    def _close_message(self, status: str) -> list[dict[str, Any]]:
        index = len(self.output)
        item = self._message(self.text, status)
        self.output.append(item)
        where = {"item_id": self.message_id, "output_index": index, "content_index": 0}
        return [
            self._event("response.output_text.done", **where, text=self.text, logprobs=[]),
            self._event("response.content_part.done", **where, part=item["content"][0]),
            self._event("response.output_item.done", output_index=index, item=item),
        ]

    def _call_events(self, call: dict[str, Any]) -> list[dict[str, Any]]:
        index = len(self.output)
        item = self._call(call)
        self.output.append(item)
        arguments = item["arguments"]
        return [
            self._event("response.output_item.added", output_index=index, item=self._call(call, "in_progress")),
            self._event(
                "response.function_call_arguments.delta", item_id=item["id"], output_index=index, delta=arguments
            ),
            self._event(
                "response.function_call_arguments.done",
                item_id=item["id"],
                output_index=index,
                name=item["name"],
                arguments=arguments,
            ),
            self._event("response.output_item.done", output_index=index, item=item),
        ]

    def events(self, response: pb.GenerateResponse) -> list[dict[str, Any]]:
        chunk = self.chunk(response)  # the text held back from where a call starts; the calls at the end
        if chunk is None:
            return []
        choice = chunk["choices"][0]
        text = choice["delta"].get("content") or ""
        events = []
        if text:
            if not self.message_open:
                events += self._open_message()
            self.text += text
            where = {"item_id": self.message_id, "output_index": len(self.output), "content_index": 0}
            events.append(self._event("response.output_text.delta", **where, delta=text, logprobs=[]))
        if choice["finish_reason"] is None:
            return events
        incomplete = response.finish_reason in _INCOMPLETE
        calls = choice["delta"].get("tool_calls") or []
        if not self.message_open and not calls:
            events += self._open_message()  # an empty answer is still a message
        if self.message_open:
            events += self._close_message("incomplete" if incomplete else "completed")
        for call in calls:
            events += self._call_events(call)
        usage = {"prompt_tokens": self.usage.prompt_tokens, "completion_tokens": self.usage.completion_tokens}
        status = "incomplete" if incomplete else "completed"
        final = self._response(status, self.output, usage, incomplete)
        return [*events, self._event(f"response.{status}", response=final)]

    def error_event(self, status: int, body: dict[str, Any]) -> dict[str, Any]:
        error = body["error"]
        return self._event("error", code=error["code"], message=error["message"], param=error["param"])


RESPONSES = Dialect(parse_responses, ResponsesBuilder)
