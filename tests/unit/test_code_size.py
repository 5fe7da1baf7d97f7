"""Short code, checked like any other standard: no source file over 500 lines, no Python function over 80.

A file past the limit usually holds two concepts and a function past it several steps: each is split where
its parts have names of their own. The service, the client and the bench are held to it; the generated
protobuf modules (``_proto/``) are not ours to shorten. Triton kernels count like any other function.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("service", "client", "bench")
SOURCE_SUFFIXES = {".py", ".c", ".cc", ".cpp", ".cu", ".h", ".hpp"}
MAX_FILE_LINES = 500
MAX_FUNCTION_LINES = 80


def sources() -> list[Path]:
    return sorted(
        path
        for package in PACKAGES
        for path in (ROOT / package).rglob("*")
        if path.suffix in SOURCE_SUFFIXES and path.is_file() and "_proto" not in path.parts
    )


def test_the_sources_are_found() -> None:
    names = {path.relative_to(ROOT).as_posix() for path in sources()}
    assert {"service/tokenmill_service/front/http/http_api.py", "client/tokenmill_client/__init__.py"} <= names
    assert not any("/_proto/" in name for name in names)


def test_no_source_file_is_over_500_lines() -> None:
    long = []
    for path in sources():
        lines = len(path.read_text(encoding="utf-8").splitlines())
        if lines > MAX_FILE_LINES:
            long.append(f"{path.relative_to(ROOT)}: {lines} lines")
    assert not long, f"files over {MAX_FILE_LINES} lines:\n" + "\n".join(long)


def long_functions(path: Path, root: Path = ROOT) -> list[str]:
    """Each function (or method) of a Python file over the limit, as 'path:line name (N lines)' (from ``root``)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            assert node.end_lineno is not None
            lines = node.end_lineno - node.lineno + 1
            if lines > MAX_FUNCTION_LINES:
                found.append(f"{path.relative_to(root)}:{node.lineno} {node.name} ({lines} lines)")
    return found


def test_long_functions_are_found(tmp_path: Path) -> None:
    """The check itself: a method of 81 lines is reported, a function of 80 is not."""
    body = "".join(f"        x{i} = {i}\n" for i in range(79))
    source = tmp_path / "sizes.py"
    source.write_text(f"def fine() -> None:\n{body}\n\nclass C:\n    def long(self) -> None:\n{body}        x = 0\n")
    assert long_functions(source, tmp_path) == ["sizes.py:84 long (81 lines)"]


def test_no_function_is_over_80_lines() -> None:
    long = [found for path in sources() if path.suffix == ".py" for found in long_functions(path)]
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines:\n" + "\n".join(long)
