"""The "# Response Formats" section a harmony prompt describes a JSON schema with, as OpenAI's harmony guide
(openai/harmony, docs/format.md, "Structured output") writes it, and the OpenAI parameters it is read from."""

from __future__ import annotations

import pytest

from tokenmill_service.contract.chat.harmony_response_format import ResponseFormat, section
from tokenmill_service.front.http.openai_constraint import ConstraintParamError, apply_constraint
from tokenmill_service.front.proto import pb

# The guide's shopping-list schema, compact as its example writes it.
SHOPPING = {
    "properties": {
        "items": {"type": "array", "description": "entries on the shopping list", "items": {"type": "string"}}
    },
    "type": "object",
}
SHOPPING_TEXT = (
    '{"properties":{"items":{"type":"array","description":"entries on the shopping list","items":{"type":"string"}}},'
    '"type":"object"}'
)


def test_the_section_is_the_guides_heading_name_description_and_compact_schema() -> None:
    fmt = ResponseFormat(SHOPPING, "shopping_list", "A shopping list.")
    assert section(fmt) == f"# Response Formats\n\n## shopping_list\n\n// A shopping list.\n{SHOPPING_TEXT}"


def test_each_line_of_a_description_is_a_comment_and_no_description_writes_none() -> None:
    assert (
        section(ResponseFormat(True, "x", "One.\r\nTwo.\n")) == "# Response Formats\n\n## x\n\n// One.\n// Two.\ntrue"
    )
    assert section(ResponseFormat({"enum": ["café"]})) == '# Response Formats\n\n## response\n\n{"enum":["café"]}'


def test_response_formats_name_and_description_go_with_its_schema() -> None:
    request = pb.GenerateRequest()
    spec = {"name": "shopping_list", "description": "A list.", "schema": SHOPPING}
    assert apply_constraint({"response_format": {"type": "json_schema", "json_schema": spec}}, request) == (
        "response_format"
    )
    assert (request.json_schema_name, request.json_schema_description) == ("shopping_list", "A list.")
    guided = pb.GenerateRequest()
    apply_constraint({"guided_json": SHOPPING}, guided)
    assert (guided.json_schema_name, guided.json_schema_description) == ("", "")
    with pytest.raises(ConstraintParamError, match=r"name' must be 1 to 64 letters.*'shopping list'") as refused:
        spec = {"name": "shopping list", "schema": SHOPPING}
        apply_constraint({"response_format": {"type": "json_schema", "json_schema": spec}}, pb.GenerateRequest())
    assert refused.value.param == "response_format.json_schema.name"
