"""The process that serves gRPC never imports torch: only worker processes do (issue 9, layering)."""

from __future__ import annotations

import subprocess
import sys


def test_the_server_and_router_modules_import_without_torch() -> None:
    # A fresh interpreter: this test process has imported torch long ago.
    code = (
        "import sys\n"
        "import tokenmill_service.main, tokenmill_service.server, tokenmill_service.router\n"
        "import tokenmill_service.messages, tokenmill_service.worker, tokenmill_service.validation\n"
        "import tokenmill_service.http_api, tokenmill_service.embeddings_api, tokenmill_service.embedding_worker\n"
        "import tokenmill_service.models.embedding_spec\n"
        "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if m.startswith('torch'))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr


def test_the_service_imports_the_generated_grpc_code_from_one_module() -> None:
    from pathlib import Path

    import tokenmill_service

    root = Path(tokenmill_service.__file__).parent
    importers = sorted(
        str(p.relative_to(root)) for p in root.rglob("*.py") if "tokenmill_client._proto" in p.read_text()
    )
    assert importers == ["proto.py"]


def test_the_engine_layers_and_ops_never_import_a_model_module() -> None:
    """Data flows engine -> model: the engine is written against a protocol (engine/causal_lm.py), and
    layers and ops know nothing of models."""
    import ast
    from pathlib import Path

    import tokenmill_service

    root = Path(tokenmill_service.__file__).parent
    offenders = []
    for package in ("engine", "layers", "ops"):
        for path in (root / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                names = [node.module or ""] if isinstance(node, ast.ImportFrom) else []
                names += [a.name for a in node.names] if isinstance(node, ast.Import) else []
                offenders += [
                    f"{path.relative_to(root)}: {n}" for n in names if n.startswith("tokenmill_service.models")
                ]
    assert offenders == []


def _imports(package: str) -> list[tuple[str, str]]:
    """(file, module) for every import in the files of ``package``, lazy and type-checking ones too."""
    import ast
    from pathlib import Path

    import tokenmill_service

    root = Path(tokenmill_service.__file__).parent
    found = []
    for path in sorted((root / package).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            names += [a.name for a in node.names] if isinstance(node, ast.Import) else []
            found += [(str(path.relative_to(root)), n) for n in names]
    return found


def test_kernels_take_tensors_and_never_import_layers_or_models() -> None:
    """Data flows model -> layers -> kernels: a kernel is given tensors, never a layer to call back."""
    offenders = [
        f"{file}: {name}"
        for file, name in _imports("kernels")
        if name.startswith(("tokenmill_service.layers", "tokenmill_service.models"))
    ]
    assert offenders == []


# The builder still takes the plan whole, and the model keeps it for the runner: until the builder takes the
# families' typed specs, the two climbs left. Any other is a new one.
BUILDER_CLIMBS = [
    "models/builder.py: tokenmill_service.plan.plan",
    "models/builder.py: tokenmill_service.plan.resolve",
    "models/decoder.py: tokenmill_service.plan.plan",
]


def test_models_never_import_the_plan() -> None:
    """The plan decides from the model families' facts; a family never reaches back to the plan."""
    offenders = [f"{file}: {name}" for file, name in _imports("models") if name.startswith("tokenmill_service.plan")]
    assert offenders == BUILDER_CLIMBS


def test_outside_kernels_only_the_interface_is_imported() -> None:
    """Code outside kernels/ reaches the kernels through the package (kernels/__init__.py), not its bindings."""
    import ast
    from pathlib import Path

    import tokenmill_service

    root = Path(tokenmill_service.__file__).parent
    offenders = [
        f"{file}: {name}"
        for package in sorted(p.name for p in root.iterdir() if p.is_dir() and p.name != "kernels")
        for file, name in _imports(package)
        if name.startswith(("tokenmill_service.kernels.cpu", "tokenmill_service.kernels.triton"))
    ]
    offenders += [
        f"{path.name}: {node.module}"
        for path in root.glob("*.py")
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("tokenmill_service.kernels.")
    ]
    assert offenders == []
