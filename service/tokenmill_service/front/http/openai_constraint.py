"""The OpenAI API's ways to constrain the output, as a GenerateRequest's constraint.

OpenAI's own ``response_format``: ``{"type": "json_object"}`` and ``{"type": "json_schema", "json_schema":
{"name", "description", "schema", "strict"}}`` (the schema is enforced whatever ``strict`` says; the
name and description go with it, for a harmony model's prompt). vLLM's extras, which
OpenAI's SDKs send through ``extra_body``: ``guided_json`` (a schema), ``guided_regex``, ``guided_grammar``
(Lark, or GBNF when it holds ``::=``), ``guided_choice`` (a list of strings), and the same under
``structured_outputs`` as ``json``, ``regex``, ``grammar``, ``choice``. One request takes one of them.
"""

from __future__ import annotations

import json
from typing import Any

from tokenmill_service.contract.chat.tool_calls import TOOL_NAME
from tokenmill_service.front.proto import pb


class ConstraintParamError(ValueError):
    """A malformed constraint parameter; ``param`` names it as the caller wrote it."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def _schema_text(value: Any, param: str) -> str:
    if isinstance(value, str):
        return value  # the server's validation says whether it is JSON
    if isinstance(value, dict | bool):
        return json.dumps(value)
    raise ConstraintParamError(f"'{param}' must be a JSON schema (an object)", param)


def _string(value: Any, param: str) -> str:
    if not isinstance(value, str):
        raise ConstraintParamError(f"'{param}' must be a string", param)
    return value


def _grammar(value: Any, param: str) -> pb.Grammar:
    text = _string(value, param)
    syntax = pb.GRAMMAR_SYNTAX_GBNF if "::=" in text else pb.GRAMMAR_SYNTAX_LARK
    return pb.Grammar(text=text, syntax=syntax)


def _choice(value: Any, param: str) -> pb.Grammar:
    if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
        raise ConstraintParamError(f"'{param}' must be a non-empty list of non-empty strings", param)
    # A JSON string literal is a valid Lark string literal.
    return pb.Grammar(text="start: " + " | ".join(json.dumps(c) for c in value), syntax=pb.GRAMMAR_SYNTAX_LARK)


def _response_format(value: Any) -> tuple[str, Any] | None:
    if not isinstance(value, dict):
        raise ConstraintParamError("'response_format' must be an object with a 'type'", "response_format")
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return "json_object", pb.JsonObject()
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict):
            raise ConstraintParamError(
                "'response_format.json_schema' must be an object with a 'schema'", "response_format"
            )
        if spec.get("strict") is not None and not isinstance(spec["strict"], bool):
            raise ConstraintParamError("'response_format.json_schema.strict' must be true or false", "response_format")
        if "schema" not in spec:
            return "json_object", pb.JsonObject()
        return "json_schema", _schema_text(spec["schema"], "response_format.json_schema.schema")
    raise ConstraintParamError(
        f"'response_format.type' must be 'text', 'json_object' or 'json_schema'; given {kind!r}", "response_format"
    )


def _describe(spec: dict[str, Any], request: pb.GenerateRequest) -> None:
    """Set response_format.json_schema's name and description, which a harmony model is shown with the schema."""
    name = spec.get("name")
    if name is not None:
        request.json_schema_name = _string(name, "response_format.json_schema.name")
        if not TOOL_NAME.fullmatch(name):
            raise ConstraintParamError(
                f"'response_format.json_schema.name' must be 1 to 64 letters, digits, '_' or '-'; given {name!r}",
                "response_format.json_schema.name",
            )
    description = spec.get("description")
    if description is not None:
        request.json_schema_description = _string(description, "response_format.json_schema.description")


def apply_constraint(body: dict[str, Any], request: pb.GenerateRequest) -> str | None:
    """Set ``request``'s constraint from the body; returns the parameter it came from (None: none given)."""
    found: list[tuple[str, str, Any]] = []
    if body.get("response_format") is not None:
        got = _response_format(body["response_format"])
        if got is not None:
            found.append(("response_format", *got))
    extras = {
        "guided_json": ("json_schema", _schema_text),
        "guided_regex": ("regex", _string),
        "guided_grammar": ("grammar", _grammar),
        "guided_choice": ("grammar", _choice),
    }
    for name, (field_name, convert) in extras.items():
        if body.get(name) is not None:
            found.append((name, field_name, convert(body[name], name)))
    outputs = body.get("structured_outputs")
    if outputs is not None:
        if not isinstance(outputs, dict):
            raise ConstraintParamError("'structured_outputs' must be an object", "structured_outputs")
        nested = {
            "json": "guided_json",
            "regex": "guided_regex",
            "grammar": "guided_grammar",
            "choice": "guided_choice",
        }
        for key, value in outputs.items():
            if key not in nested:
                raise ConstraintParamError(
                    f"'structured_outputs.{key}' is not supported; use one of {', '.join(nested)}", "structured_outputs"
                )
            field_name, convert = extras[nested[key]]
            found.append((f"structured_outputs.{key}", field_name, convert(value, f"structured_outputs.{key}")))
    if not found:
        return None
    if len(found) > 1:
        names = ", ".join(f"'{name}'" for name, _, _ in found)
        raise ConstraintParamError(f"give at most one output constraint; given {names}", found[1][0])
    param, field_name, value = found[0]
    if param == "response_format" and body["response_format"]["type"] == "json_schema":
        # (Checked without a schema too, where the answer is any object: the name is still the caller's mistake.)
        _describe(body["response_format"]["json_schema"], request)
    if field_name == "json_object" or field_name == "grammar":
        getattr(request, field_name).CopyFrom(value)
    else:
        setattr(request, field_name, value)
    return param
