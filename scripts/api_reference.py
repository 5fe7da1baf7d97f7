"""The API reference pages of the documentation site, generated from the sources that define the APIs.

    python scripts/api_reference.py OUT_DIR   # writes OUT_DIR/grpc.md and OUT_DIR/http.md

- ``grpc_reference()``: the .proto files under protos/, read through protoc (grpcio-tools) as a descriptor set
  with ``--include_source_info``, so that every service, RPC, message, field, enum and value has its comment.
- ``http_reference()``: the OpenAPI 3.1 document the server serves at GET /openapi.json, built by
  ``tokenmill_service.front.http.openapi.document`` with the default settings' limits and no model (the bounds that
  depend on the model, its context and vocabulary, are left out as a loading server leaves them out).

The site's build (scripts/mkdocs_hooks.py) calls both, so the pages are never committed and never stale.
"""

from __future__ import annotations

import json
import re
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from google.protobuf import descriptor_pb2 as d

REPO = Path(__file__).resolve().parent.parent
PROTO_ROOT = REPO / "protos"

# Field numbers of the descriptor messages, as SourceCodeInfo.Location.path spells a declaration's place.
_FILE_MESSAGE, _FILE_ENUM, _FILE_SERVICE = 4, 5, 6
_MESSAGE_FIELD, _MESSAGE_NESTED, _MESSAGE_ENUM, _MESSAGE_ONEOF = 2, 3, 4, 8
_ENUM_VALUE, _SERVICE_METHOD = 2, 2

_SCALARS = {
    number: name.removeprefix("TYPE_").lower()
    for name, number in d.FieldDescriptorProto.Type.items()
    if name not in ("TYPE_MESSAGE", "TYPE_ENUM", "TYPE_GROUP")
}


def anchor(heading: str) -> str:
    """The anchor of a heading, as GitHub and the site (pymdownx's slugify) both make it."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def cell(text: str) -> str:
    """Text for one table cell: one line, pipes escaped."""
    return " ".join(text.split()).replace("|", "\\|")


def paragraph(comment: str) -> str:
    """A comment as prose: its lines joined into paragraphs (a blank comment line separates two)."""
    return "\n\n".join(" ".join(part.split()) for part in re.split(r"\n\s*\n", comment.strip()) if part.strip())


# --- gRPC ------------------------------------------------------------------------------------------------


def descriptor_set(proto_root: Path = PROTO_ROOT) -> d.FileDescriptorSet:
    """Every .proto under ``proto_root`` compiled by protoc, with the comments (source info) kept."""
    from grpc_tools import protoc  # type: ignore[import-untyped]  # the dev extra's, pinned for `make proto`

    protos = sorted(str(p.relative_to(proto_root)) for p in proto_root.rglob("*.proto"))
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "descriptors.pb"
        args = ["protoc", f"-I{proto_root}", f"--descriptor_set_out={out}", "--include_source_info", *protos]
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed on {protos}")
        return d.FileDescriptorSet.FromString(out.read_bytes())


class _Proto:
    """One .proto file's declarations with their comments, rendered as markdown."""

    def __init__(self, file: d.FileDescriptorProto) -> None:
        self.file = file
        self.comments = {
            tuple(loc.path): loc.leading_comments.strip() or loc.trailing_comments.strip()
            for loc in file.source_code_info.location
        }
        self.package = "." + file.package if file.package else ""

    def comment(self, *path: int) -> str:
        return self.comments.get(path, "")

    def short(self, full_name: str) -> str:
        """A type's name within this package (``.tokenmill.v1.Token`` is ``Token``)."""
        return full_name.removeprefix(self.package + ".").lstrip(".")

    def type_link(self, full_name: str) -> str:
        name = self.short(full_name)
        return f"[`{name}`](#{anchor(name)})" if not full_name.startswith(".google.") else f"`{name}`"

    def messages(self) -> Iterator[tuple[str, d.DescriptorProto, tuple[int, ...]]]:
        def walk(
            prefix: str, messages: Any, path: tuple[int, ...]
        ) -> Iterator[tuple[str, d.DescriptorProto, tuple[int, ...]]]:
            for i, message in enumerate(messages):
                name = prefix + message.name
                here = (*path, i)
                if not message.options.map_entry:
                    yield name, message, here
                yield from walk(name + ".", message.nested_type, (*here, _MESSAGE_NESTED))

        return walk("", self.file.message_type, (_FILE_MESSAGE,))

    def enums(self) -> Iterator[tuple[str, d.EnumDescriptorProto, tuple[int, ...]]]:
        for i, enum in enumerate(self.file.enum_type):
            yield enum.name, enum, (_FILE_ENUM, i)
        for name, message, path in self.messages():
            for i, enum in enumerate(message.enum_type):
                yield f"{name}.{enum.name}", enum, (*path, _MESSAGE_ENUM, i)

    def map_entries(self) -> dict[str, d.DescriptorProto]:
        entries: dict[str, d.DescriptorProto] = {}

        def walk(prefix: str, messages: Any) -> None:
            for message in messages:
                full = f"{prefix}.{message.name}"
                if message.options.map_entry:
                    entries[full] = message
                walk(full, message.nested_type)

        walk(self.package, self.file.message_type)
        return entries

    def field_type(self, field: d.FieldDescriptorProto, maps: dict[str, d.DescriptorProto]) -> str:
        if field.type_name in maps:
            key, value = maps[field.type_name].field
            return f"map<{self.field_type(key, maps)}, {self.field_type(value, maps)}>"
        kind = self.type_link(field.type_name) if field.type_name else f"`{_SCALARS[field.type]}`"
        if field.label == d.FieldDescriptorProto.LABEL_REPEATED:
            return f"repeated {kind}"
        return f"optional {kind}" if field.proto3_optional else kind

    def render(self) -> list[str]:
        lines = [f"Source: `protos/{self.file.name}`, package `{self.file.package}`."]
        header = [loc.leading_detached_comments for loc in self.file.source_code_info.location if loc.path == [12]]
        for detached in header[0] if header else ():
            lines += ["", paragraph(detached)]
        for i, service in enumerate(self.file.service):
            lines += ["", f"## Service {service.name}", "", paragraph(self.comment(_FILE_SERVICE, i)), ""]
            lines += ["| RPC | request | response |", "|---|---|---|"]
            for j, method in enumerate(service.method):
                stream_in = "stream " if method.client_streaming else ""
                stream_out = "stream " if method.server_streaming else ""
                lines.append(
                    f"| [`{method.name}`](#{anchor(service.name + '.' + method.name)}) "
                    f"| {stream_in}{self.type_link(method.input_type)} "
                    f"| {stream_out}{self.type_link(method.output_type)} |"
                )
            for j, method in enumerate(service.method):
                lines += ["", f"### {service.name}.{method.name}", ""]
                signature = (
                    f"rpc {method.name}({'stream ' if method.client_streaming else ''}{self.short(method.input_type)})"
                    f" returns ({'stream ' if method.server_streaming else ''}{self.short(method.output_type)})"
                )
                lines += [f"`{signature}`", "", paragraph(self.comment(_FILE_SERVICE, i, _SERVICE_METHOD, j))]
        maps = self.map_entries()
        lines += ["", "## Message types"]
        for name, message, path in self.messages():
            lines += ["", f"### {name}", ""]
            if about := self.comment(*path):
                lines += [paragraph(about), ""]
            if not message.field:
                lines.append("No fields.")
                continue
            oneofs = [o.name for o in message.oneof_decl]
            lines += ["| field | number | type | description |", "|---|---|---|---|"]
            for k, field in enumerate(message.field):
                about = self.comment(*path, _MESSAGE_FIELD, k)
                if field.HasField("oneof_index") and not field.proto3_optional:
                    oneof = oneofs[field.oneof_index]
                    group = self.comment(*path, _MESSAGE_ONEOF, field.oneof_index)
                    about = f"One of `{oneof}`{' (' + group + ')' if group else ''}. {about}"
                lines.append(f"| `{field.name}` | {field.number} | {self.field_type(field, maps)} | {cell(about)} |")
        lines += ["", "## Enum types"]
        for name, enum, path in self.enums():
            lines += ["", f"### {name}", ""]
            if about := self.comment(*path):
                lines += [paragraph(about), ""]
            lines += ["| value | number | description |", "|---|---|---|"]
            for k, value in enumerate(enum.value):
                lines.append(f"| `{value.name}` | {value.number} | {cell(self.comment(*path, _ENUM_VALUE, k))} |")
        return lines


def grpc_reference(proto_root: Path = PROTO_ROOT) -> str:
    lines = [
        "# gRPC API reference",
        "",
        "Generated from the `.proto` files when this site is built: every service, RPC, message, field and enum",
        "with the comment that documents it. The errors, logprobs and reproducibility are explained in",
        "[The gRPC API](../grpc-api.md).",
    ]
    for file in descriptor_set(proto_root).file:
        lines += ["", *_Proto(file).render()]
    return "\n".join(lines) + "\n"


# --- HTTP (OpenAPI) --------------------------------------------------------------------------------------


def openapi_document() -> dict[str, Any]:
    """GET /openapi.json as a server with the default flags serves it while its model is loading."""
    from tokenmill_service import __version__
    from tokenmill_service.contract.config import Settings
    from tokenmill_service.front.http.openapi import document
    from tokenmill_service.front.validation import Limits

    return document(Limits.from_settings(Settings()), __version__)


def schema_type(schema: dict[str, Any]) -> str:
    """A schema's type in a few words: ``integer``, ``string or null``, ``array of string``, ``"auto" or "none"``."""
    if "$ref" in schema:
        name = schema["$ref"].rsplit("/", 1)[-1]
        return f"[{name}](#{anchor(name)})"
    if "const" in schema:
        return f"`{json.dumps(schema['const'])}`"
    if "enum" in schema:
        return " or ".join(f"`{json.dumps(v)}`" for v in schema["enum"])
    for key in ("anyOf", "oneOf"):
        if key in schema:
            return " or ".join(dict.fromkeys(schema_type(option) for option in schema[key]))
    kinds = schema.get("type", [])
    kinds = [kinds] if isinstance(kinds, str) else list(kinds)
    named = []
    for kind in kinds:
        if kind == "array" and isinstance(schema.get("items"), dict):
            named.append(f"array of {schema_type(schema['items'])}")
        else:
            named.append(kind)
    return " or ".join(named) if named else "any"


_BOUNDS = (
    ("minimum", "≥ {}"),
    ("exclusiveMinimum", "> {}"),
    ("maximum", "≤ {}"),
    ("exclusiveMaximum", "< {}"),
    ("minLength", "at least {} characters"),
    ("maxLength", "at most {} characters"),
    ("minItems", "at least {} items"),
    ("maxItems", "at most {} items"),
    ("maxProperties", "at most {} keys"),
    ("pattern", "matches `{}`"),
    ("default", "default `{}`"),
)


def bounds(schema: dict[str, Any]) -> str:
    said = [text.format(schema[key]) for key, text in _BOUNDS if key in schema]
    for key in ("anyOf", "oneOf"):  # a nullable value's bounds are on its non-null option
        for option in schema.get(key, ()):
            if option.get("type") != "null":
                said += [b for b in [bounds(option)] if b]
    return ", ".join(said)


def _object_options(schema: dict[str, Any]) -> list[dict[str, Any]]:
    """The object schemas a value may be (its own, or its anyOf/oneOf options'), whose fields are listed."""
    if "properties" in schema:
        return [schema]
    if schema.get("type") == "array" or "array" in schema.get("type", []):
        items = schema.get("items")
        return _object_options(items) if isinstance(items, dict) else []
    found = []
    for key in ("anyOf", "oneOf"):
        for option in schema.get(key, ()):
            found += _object_options(option)
    return found


def _kinds(schema: dict[str, Any]) -> set[str]:
    kinds = schema.get("type", [])
    found = {kinds} if isinstance(kinds, str) else set(kinds)
    for key in ("anyOf", "oneOf"):
        for option in schema.get(key, ()):
            found |= _kinds(option)
    return found


def description(schema: dict[str, Any]) -> str:
    """A value's description, or its options' (a nullable value describes its non-null option)."""
    said = [schema["description"]] if "description" in schema else []
    for key in ("anyOf", "oneOf"):
        said += [description(option) for option in schema.get(key, ()) if description(option)]
    return "; ".join(dict.fromkeys(said))


def field_rows(schema: dict[str, Any], prefix: str = "", depth: int = 0) -> Iterator[str]:
    """One table row per property, nested objects' properties under their dotted names (``[]`` for arrays)."""
    for option in _object_options(schema):
        required = set(option.get("required", ()))
        for name, sub in option["properties"].items():
            is_array = "array" in _kinds(sub)
            path = f"{prefix}{name}"
            yield (
                f"| `{path}` | {cell(schema_type(sub))} | {'yes' if name in required else ''} "
                f"| {cell(bounds(sub))} | {cell(description(sub))} |"
            )
            if depth < 3:
                yield from field_rows(sub, f"{path}{'[]' if is_array else ''}.", depth + 1)


def fields_table(schema: dict[str, Any]) -> list[str]:
    rows = list(dict.fromkeys(field_rows(schema)))
    if not rows:
        return [f"A JSON value: {schema_type(schema)}."]
    return ["| field | type | required | bounds | description |", "|---|---|---|---|---|", *rows]


def http_reference(doc: dict[str, Any] | None = None) -> str:
    doc = doc if doc is not None else openapi_document()
    lines = [
        "# HTTP API reference",
        "",
        "Generated from the server's OpenAPI document (`GET /openapi.json`) when this site is built: every route,",
        "its request body's fields with their types, bounds and descriptions, and its answers. The bounds are those",
        "of the default flags; a server also bounds what depends on its model (token ids below its vocabulary's",
        "size), and its own /openapi.json says so. The parameters are explained in",
        "[The OpenAI-compatible HTTP API](../http-api.md).",
        "",
        paragraph(doc["info"].get("description", "")),
        "",
        "| route | what |",
        "|---|---|",
    ]
    operations = [(path, method, op) for path, ops in doc["paths"].items() for method, op in ops.items()]
    for path, method, op in operations:
        title = f"{method.upper()} {path}"
        lines.append(f"| [`{title}`](#{anchor(title)}) | {cell(op.get('summary', ''))} |")
    for path, method, op in operations:
        lines += ["", f"## {method.upper()} {path}", "", paragraph(op.get("summary", "")), ""]
        if op.get("security") == []:
            lines += ["No token needed.", ""]
        body = op.get("requestBody", {}).get("content", {}).get("application/json", {}).get("schema")
        if body is not None:
            lines += ["### Request body", "", *fields_table(body), ""]
        lines += ["### Answers", "", "| status | content | meaning |", "|---|---|---|"]
        for status, answer in op["responses"].items():
            content = answer.get("content", {})
            kinds = ", ".join(
                f"{media}: {schema_type(c['schema'])}" if "$ref" in c.get("schema", {}) else media
                for media, c in content.items()
            )
            lines.append(f"| {status} | {cell(kinds)} | {cell(answer.get('description', ''))} |")
    lines += ["", "## Answer schemas"]
    for name, schema in doc["components"]["schemas"].items():
        lines += ["", f"### {name}", ""]
        if "description" in schema:
            lines += [paragraph(schema["description"]), ""]
        lines += fields_table(schema)
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__.strip().splitlines()[2], file=sys.stderr)
        return 2
    out = Path(argv[0])
    out.mkdir(parents=True, exist_ok=True)
    (out / "grpc.md").write_text(grpc_reference())
    (out / "http.md").write_text(http_reference())
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
