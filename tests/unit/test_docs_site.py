"""The documentation site: `mkdocs build --strict` passes (every page in the nav, every link and anchor found),
its home page is the README, and its API reference says everything the .proto and /openapi.json define."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def script(name: str) -> ModuleType:
    sys.path.insert(0, str(ROOT / "scripts"))
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("site")
    built = subprocess.run(
        [str(BIN / "mkdocs"), "build", "--strict", "--site-dir", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert built.returncode == 0, built.stdout + built.stderr
    return out


def test_the_site_builds_strict_with_every_doc_in_its_nav(site: Path) -> None:
    for doc in (ROOT / "docs").glob("*.md"):
        assert (site / doc.stem / "index.html").is_file(), doc.name
    home = (site / "index.html").read_text()
    assert "make run" in home and 'href="client/"' in home  # the README, its docs/ links made the site's
    assert "https://github.com/tokenmill/tokenmill/blob/main/bench/RESULTS.md" in home  # outside docs/: GitHub's


def test_the_grpc_reference_has_every_service_rpc_message_field_and_enum_with_its_comment(site: Path) -> None:
    api = script("api_reference")
    page = api.grpc_reference()
    assert (site / "reference" / "grpc" / "index.html").is_file()
    described = 0
    for file in api.descriptor_set().file:
        proto = api._Proto(file)
        for i, service in enumerate(file.service):
            assert f"## Service {service.name}" in page
            for j, method in enumerate(service.method):
                assert f"### {service.name}.{method.name}" in page
                assert api.paragraph(proto.comment(6, i, 2, j)) in page
        for name, message, path in proto.messages():
            assert f"### {name}\n" in page, name
            for k, field in enumerate(message.field):
                comment = api.cell(proto.comment(*path, 2, k))
                assert f"| `{field.name}` | {field.number} |" in page and comment in page, (name, field.name)
                described += bool(comment)
        for name, enum, path in proto.enums():
            for value in enum.value:
                assert f"| `{value.name}` | {value.number} |" in page, (name, value.name)
    assert described > 100, described  # the fields are commented, and their comments are read


def test_the_http_reference_has_every_route_and_every_request_field(site: Path) -> None:
    api = script("api_reference")
    doc = api.openapi_document()
    page = api.http_reference(doc)
    assert (site / "reference" / "http" / "index.html").is_file()
    for path, operations in doc["paths"].items():
        for method, operation in operations.items():
            assert f"## {method.upper()} {path}\n" in page
            schema = operation.get("requestBody", {}).get("content", {}).get("application/json", {}).get("schema")
            for option in api._object_options(schema or {}):
                for field in option["properties"]:
                    assert f"| `{field}` |" in page, (path, field)
    assert "| `max_tokens` | integer or null |  | ≥ 0, ≤ 4096 |" in page  # the default flags' bound


def test_links_are_rewritten_for_the_site_as_github_reads_them() -> None:
    hooks = script("mkdocs_hooks")
    docs, repo = ROOT / "docs", "https://github.com/o/r"
    readme = "[c](docs/client.md#the-python-client) [r](bench/RESULTS.md) [p](#performance)\n```\n[x](docs/a.md)\n```"
    assert hooks.rewrite_links(readme, ROOT / "README.md", "index.md", docs, repo) == (
        "[c](client.md#the-python-client) [r](https://github.com/o/r/blob/main/bench/RESULTS.md) [p](#performance)"
        "\n```\n[x](docs/a.md)\n```"
    )
    page = "[h](../README.md#quickstart) [k](../helm/tokenmill) ![t](../bench/results/throughput.png) [o](lora.md)"
    assert hooks.rewrite_links(page, docs / "client.md", "client.md", docs, repo) == (
        "[h](index.md#quickstart) [k](https://github.com/o/r/tree/main/helm/tokenmill) "
        "![t](https://github.com/o/r/raw/main/bench/results/throughput.png) [o](lora.md)"
    )
