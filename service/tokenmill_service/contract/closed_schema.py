"""A JSON schema's silences about extra keys and items, read as "nothing more than it declares".

JSON Schema lets an object hold keys its ``properties`` do not list unless ``additionalProperties`` says
otherwise, and an array hold any items when ``items`` is not given. Schemas made from pydantic models (by
instructor, LangChain, the openai SDK) leave ``additionalProperties`` out, so under the literal reading a
small model adds key after key until max_tokens. xgrammar (vLLM's default grammar engine) reads such
schemas strictly by default, and so does tokenmill; ``--json-schema-permissive`` keeps JSON Schema's
reading, and a schema can always say ``additionalProperties: true`` or give ``items`` itself.

As xgrammar's strict mode:
- an object schema that lists ``properties`` (or ``patternProperties``) and says neither
  ``additionalProperties`` nor ``unevaluatedProperties`` admits only those keys (and the keys ``required``
  names); one that lists none, ``{"type": "object"}``, is any object;
- an array schema that gives no ``items``, ``additionalItems`` or ``unevaluatedItems`` admits only its
  ``prefixItems`` (none: only ``[]``), except ``{"type": "array"}`` alone, which is any array.

A schema that is one part of an intersection (a branch of an ``allOf`` with several, or one beside a
``$ref`` or ``allOf``) keeps its own reading: closing each part would refuse the keys the others declare.
"""

from __future__ import annotations

from typing import Any

# Keywords that say nothing about which values match (xgrammar leaves them out when it asks whether an array
# schema is a bare {"type": "array"}).
ANNOTATIONS = frozenset(
    {"title", "description", "default", "examples", "deprecated", "readOnly", "writeOnly", "$comment", "$schema"}
)
# Where a schema holds other schemas: one, a list of them, or a map of names to them.
ONE_SCHEMA = ("items", "additionalItems", "unevaluatedItems", "additionalProperties", "unevaluatedProperties",
              "contains", "propertyNames", "not", "if", "then", "else")  # fmt: skip
LIST_OF_SCHEMAS = ("anyOf", "oneOf", "allOf", "prefixItems", "items")
MAP_OF_SCHEMAS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def close_schema(schema: Any) -> Any:
    """``schema`` (a parsed JSON schema, changed in place and returned) with every object and array
    schema closed as the module says."""
    stack: list[tuple[Any, bool]] = [(schema, False)]
    while stack:  # (iterative: a schema may nest deeper than Python recurses)
        node, in_intersection = stack.pop()
        if not isinstance(node, dict):
            continue
        if not in_intersection and "$ref" not in node and "allOf" not in node:
            _close_object(node)
        _close_array(node)
        for key in ONE_SCHEMA:
            if isinstance(node.get(key), dict):
                stack.append((node[key], False))
        for key in LIST_OF_SCHEMAS:
            if isinstance(node.get(key), list):
                parts = node[key]
                stack.extend((part, key == "allOf" and len(parts) > 1) for part in parts)
        for key in MAP_OF_SCHEMAS:
            if isinstance(node.get(key), dict):
                stack.extend((sub, False) for sub in node[key].values())
    return schema


def _close_object(node: dict[str, Any]) -> None:
    if "additionalProperties" in node or "unevaluatedProperties" in node:
        return
    properties = node.get("properties")
    if not isinstance(properties, dict) and "patternProperties" not in node:
        return
    if isinstance(properties, dict):
        # A required key the schema does not describe is declared all the same: any value.
        required = node.get("required")
        for name in required if isinstance(required, list) else ():
            if isinstance(name, str) and name not in properties:
                properties[name] = True
    node["additionalProperties"] = False


def _close_array(node: dict[str, Any]) -> None:
    kind = node.get("type")
    is_array = kind == "array" or (isinstance(kind, list) and "array" in kind) or "prefixItems" in node
    if not is_array or any(k in node for k in ("items", "additionalItems", "unevaluatedItems")):
        return
    if all(k in ANNOTATIONS for k in node if k != "type"):
        return  # {"type": "array"} alone: any array, as in xgrammar
    node["items"] = False
