"""Tool calling: how a model family writes a call, the prompt that offers tools, the grammar that forces a
call, and the parser that reads calls back out of the generated text.

A family is a row of ``FAMILIES``: the text around one call and how calls are separated. A call's body is
always ``{"name": ..., "arguments": {...}}`` (Llama 3 names the arguments "parameters"). Adding a family
is adding a row (and, when its template says so, a clause in ``family_for``).

When the chat template renders ``tools`` itself it gets them; otherwise (the embedded SmolLM2's) the tools
are offered in a system message in Hermes' words, which is also the format SmolLM2 was trained on.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass
from typing import Any

from tokenmill_service.contract.closed_schema import close_schema

# Tool-call JSON written the way the JSON schema constraint writes it (contract/grammar.py).
# What a tool's name may be.
TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
X_GUIDANCE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True, slots=True)
class ToolFamily:
    name: str
    start: str  # text before one call (where a parser starts looking; "" = the text is the call)
    end: str  # text after one call
    separator: str  # between two calls
    arguments_key: str = "arguments"


FAMILIES = {
    # Hermes, Qwen 2/2.5/3, SmolLM2 and SmolLM3: <tool_call>{json}</tool_call>, one per call.
    "hermes": ToolFamily("hermes", "<tool_call>\n", "\n</tool_call>", "\n"),
    # Llama 3.1-3.3's JSON tool calling: the answer is the call; several are joined by "; ".
    "llama3_json": ToolFamily("llama3_json", "", "", "; ", "parameters"),
}


def family_for(template: str | None) -> ToolFamily:
    """The family a chat template writes calls in (Hermes' when it does not say)."""
    if template and ("<|python_tag|>" in template or "<|eom_id|>" in template):
        return FAMILIES["llama3_json"]
    return FAMILIES["hermes"]


@dataclass(frozen=True, slots=True)
class Tool:
    name: str
    description: str
    parameters: dict[str, Any]  # a JSON schema for the arguments object

    def openai_json(self) -> dict[str, Any]:
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }


@dataclass(frozen=True, slots=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


def tools_prompt(tools: list[Tool], family: ToolFamily) -> str:
    """A system message offering the tools, for templates that do not render them."""
    listing = "\n".join(json.dumps(t.openai_json(), ensure_ascii=False) for t in tools)
    example = call_text("function_name", "{...}", family)
    return (
        "You are a function calling AI model. You are provided with function signatures within <tools></tools> "
        "XML tags. You may call one or more functions to assist with the user query. Don't make assumptions "
        "about what values to plug into functions.\n"
        f"<tools>\n{listing}\n</tools>\n"
        f"For each function call, return a JSON object with the function name and arguments:\n{example}"
    )


def call_text(name: str, arguments: str, family: ToolFamily) -> str:
    """One call as the family writes it (for assistant messages in the history)."""
    body = f'{{"name": {json.dumps(name)}, "{family.arguments_key}": {arguments}}}'
    return family.start + body + family.end


def call_grammar(tools: list[Tool], family: ToolFamily, parallel: bool, permissive: bool = False) -> str:
    """A Lark grammar (llguidance's, with %json) that only admits calls of ``tools`` whose arguments are
    valid against their schemas (closed unless ``permissive``: contract/closed_schema.py): exactly one call,
    after which the answer can only end, or with ``parallel`` one or more.

    A line break may follow the last of several calls: a model that writes the one it usually ends a call
    with is not thereby committed to another call (SmolLM2, held to Hermes' "\n" separator, wrote the same
    call again)."""
    options = []
    for t in tools:
        arguments = json.loads(json.dumps(t.parameters)) if t.parameters else {"type": "object", "properties": {}}
        options.append(
            {
                "type": "object",
                "properties": {"name": {"const": t.name}, family.arguments_key: arguments},
                "required": ["name", family.arguments_key],
                "additionalProperties": False,
            }
        )
    schema: dict[str, Any] = options[0] if len(options) == 1 else {"anyOf": options}
    if not permissive:
        close_schema(schema)
    schema = {**schema, "x-guidance": X_GUIDANCE}
    parts = [json.dumps(family.start)] if family.start else []
    parts.append(f"%json {json.dumps(schema)}")
    parts += [json.dumps(family.end)] if family.end else []
    call = " ".join(parts)
    if parallel:
        return f'start: call ({json.dumps(family.separator)} call)* "\\n"?\ncall: {call}\n'
    return f"start: call\ncall: {call}\n"


def start_marker(family: ToolFamily) -> str:
    """What opens the first call in the output ("{" for families whose whole answer is the call)."""
    return family.start.strip() or "{"


def parse_calls(text: str, family: ToolFamily) -> tuple[str, list[ToolCall]]:
    """(content before the calls, the calls) read from generated text; no calls: (text, []). A call made
    again with the same arguments is read once (see repeats_a_call)."""
    content, calls = _read_calls(text, family)
    distinct: list[ToolCall] = []
    for call in calls:
        if not any(c.name == call.name and c.arguments == call.arguments for c in distinct):
            distinct.append(call)
    return content, distinct


def repeats_a_call(text: str, family: ToolFamily) -> bool:
    """Whether the text makes a call it already made, with the same arguments: a small model that a grammar
    lets make several calls may repeat one until max_new_tokens, which a grammar fixed before the answer
    cannot forbid; the answer ends there instead (generation.py)."""
    calls = _read_calls(text, family)[1]
    return len({(c.name, c.arguments) for c in calls}) < len(calls)


def _read_calls(text: str, family: ToolFamily) -> tuple[str, list[ToolCall]]:
    marker = start_marker(family)
    at = text.find(marker)
    if at < 0 or (not family.start and text[:at].strip()):
        return text, []
    content, rest = text[:at], text[at:]
    calls: list[ToolCall] = []
    decoder = json.JSONDecoder()
    pos = 0
    while True:
        if family.start:
            found = rest.find(family.start.strip(), pos)
            if found < 0:
                break
            pos = found + len(family.start.strip())
        pos = len(rest) - len(rest[pos:].lstrip())
        try:
            obj, end = decoder.raw_decode(rest, pos)
        except json.JSONDecodeError:
            break
        args = obj.get(family.arguments_key, obj.get("arguments")) if isinstance(obj, dict) else None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not isinstance(args, dict):
            break
        calls.append(ToolCall(new_call_id(), obj["name"], json.dumps(args, ensure_ascii=False)))
        pos = end
        if family.end:
            pos = len(rest) - len(rest[pos:].lstrip())
            if rest.startswith(family.end.strip(), pos):
                pos += len(family.end.strip())
        if not family.start:
            sep = re.match(r"\s*;\s*", rest[pos:])
            if sep is None:
                break
            pos += sep.end()
    return (content.strip(), calls) if calls else (text, [])


class HeldText:
    """An answer's text as it streams, held back from where a call may begin, so that a call's markup never
    reaches the caller as text: the calls read from it take its place. Held text is shown only when the
    answer ended by itself and no call could be read from it (the model wrote something else); a call cut
    off (max_new_tokens, a stop string) is never shown as text."""

    def __init__(self, family: ToolFamily) -> None:
        self.marker = start_marker(family)
        # A family whose call is the whole answer (Llama 3's): a call can only begin it.
        self.anywhere = bool(family.start)
        self.pending = ""
        self.in_call = False
        self.shown_any = False

    def add(self, text: str) -> str:
        """What of the text so far can be shown now."""
        self.pending += text
        if self.in_call:
            return ""
        if not self.anywhere:
            if self.shown_any:
                return self.flush()
            head = self.pending.lstrip()
            if head.startswith(self.marker):
                self.in_call = True
                return ""
            if not head or self.marker.startswith(head):
                return ""
            self.shown_any = True
            return self.flush()
        at = self.pending.find(self.marker)
        if at >= 0:
            shown, self.pending, self.in_call = self.pending[:at], self.pending[at:], True
            return shown
        # Keep back the longest tail that could still grow into the marker.
        keep = next(
            (
                k
                for k in range(min(len(self.marker) - 1, len(self.pending)), 0, -1)
                if self.marker.startswith(self.pending[-k:])
            ),
            0,
        )
        shown = self.pending[: len(self.pending) - keep]
        self.pending = self.pending[len(self.pending) - keep :]
        return shown

    def end(self, read_calls: bool, ended_by_itself: bool) -> str:
        """What is left to show when the answer ends."""
        if read_calls or (self.in_call and not ended_by_itself):
            self.pending = ""
        return self.flush()

    def flush(self) -> str:
        text, self.pending = self.pending, ""
        return text
