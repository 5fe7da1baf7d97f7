"""A structured answer's format, described to a harmony model (gpt-oss) in its developer message.

OpenAI's harmony guide (openai/harmony, docs/format.md, "Structured output") defines the response format "at
the end of the developer message" with this structure:

    # Response Formats

    ## {format name}

    // {description or context}
    {schema}

the schema being a JSON Schema, written as compact JSON in the guide's example. The developer message's
sections (``# Instructions``, then ``# Tools``) are joined by a blank line, as openai-harmony's renderer joins
them, and this one comes last. openai-harmony (0.0.8) has no API for it and vLLM's gpt-oss serving code does
not write it, so it is rendered here: a text content after the developer message's own (instructions and
tools stay openai-harmony's, so the system message still says where function calls go). The description's
lines are comments, each after ``// `` (as harmony writes a tool's description); without one, no comment line.

Only a JSON schema is described (OpenAI's ``json_schema`` response format, the ``guided_json`` extra, a gRPC
``json_schema``): the guide describes no other format, so ``json_object``, a regex, a grammar or a choice
constrain the answer (harmony_constraint.py) without a word in the prompt. The description helps the model
write what the grammar will accept; the grammar is what guarantees it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

HEADING = "# Response Formats"
# When the caller names no format (a gRPC json_schema without json_schema_name, the guided_json extra).
DEFAULT_NAME = "response"
# Between the developer message's sections, as openai-harmony joins them.
SECTION_BREAK = "\n\n"


@dataclass(frozen=True, slots=True)
class ResponseFormat:
    """A JSON schema the answer must match, with the name and description the model is shown."""

    schema: Any  # the JSON Schema, parsed
    name: str = DEFAULT_NAME
    description: str = ""


def section(fmt: ResponseFormat) -> str:
    """The ``# Response Formats`` section describing ``fmt``."""
    lines = [HEADING, "", f"## {fmt.name}", ""]
    lines += [f"// {line}" for line in _lines(fmt.description)]
    lines.append(json.dumps(fmt.schema, ensure_ascii=False, separators=(",", ":")))
    return "\n".join(lines)


def developer_message(developer: Any, fmt: ResponseFormat | None) -> Any:
    """The harmony developer message of ``developer`` (openai-harmony's DeveloperContent: instructions, tools),
    with ``fmt``'s section at its end when there is one."""
    import openai_harmony as oh

    if fmt is None:
        return oh.Message.from_role_and_content(oh.Role.DEVELOPER, developer)
    # Content with neither instructions nor tools renders no text: the section then opens the message.
    empty = developer.instructions is None and not developer.tools
    described = oh.TextContent(text=section(fmt) if empty else SECTION_BREAK + section(fmt))
    return oh.Message.from_role_and_contents(oh.Role.DEVELOPER, [described] if empty else [developer, described])


def _lines(text: str) -> list[str]:
    # Lines as harmony's renderer splits a description (Rust's str::lines: at "\n" or "\r\n", a last line
    # ending adding no empty line).
    lines = text.split("\n")
    if lines[-1] == "":
        lines.pop()
    return [line.removesuffix("\r") for line in lines]
