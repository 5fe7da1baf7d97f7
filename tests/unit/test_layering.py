"""The package's folders are its processes, and the imports say so.

- front/: the server process (gRPC, HTTP, the router). It never imports torch.
- contract/: what both processes import (flags, messages, requests, the plan's values, grammars, the
  tokenizer, the chat formats). It never imports torch, nor front/.
- worker/: the worker process (engine, plan, models, layers, kernels). It never imports front/.

Checked by folder, on every module in it, so that a new module is held to its folder's rule.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import tokenmill_service

PKG = "tokenmill_service"
ROOT = Path(tokenmill_service.__file__).parent
PROCESS_FOLDERS = ("front", "contract", "worker")
TORCH = ("torch", "triton")

# The only imports from the server's side into worker/, each a module that imports no torch itself.
ALLOWED_TO_WORKER = {
    ("front.router.replicas", "worker.worker"): "worker_main: the worker processes' spawn target",
    ("front.follower_node", "worker.worker"): "worker_main: the follower ranks' spawn target",
    ("contract.config", "worker.device"): "triton_unavailable_reason: --backend triton checked before start",
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


MODULES = {module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def imports(module: str) -> list[tuple[str, str]]:
    """(imported module, kind) for each import of ``module``, kind 'top', 'lazy' (inside a function) or
    'typing' (under TYPE_CHECKING). Names are package-relative for our modules; torch and triton as such.
    Importing a.b.c runs a and a.b first: those count too."""
    path = MODULES[module]
    found: list[tuple[str, str]] = []

    def add(name: str, kind: str) -> None:
        if name.split(".")[0] in TORCH:
            found.append((name.split(".")[0], kind))
        elif name.startswith(PKG + "."):
            name = name[len(PKG) + 1 :]
            while name and name not in MODULES:  # `from a import B`: B is a class of module a
                name = name.rpartition(".")[0]
            parts = name.split(".")
            found.extend((".".join(parts[:i]), kind) for i in range(1, len(parts) + 1) if name)

    def visit(node: ast.AST, kind: str) -> None:
        for child in ast.iter_child_nodes(node):
            k = "lazy" if kind == "top" and isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else kind
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                for sub in child.body:
                    visit(ast.Module(body=[sub], type_ignores=[]), "typing")
                for sub in child.orelse:
                    visit(ast.Module(body=[sub], type_ignores=[]), k)
                continue
            if isinstance(child, ast.Import):
                for alias in child.names:
                    add(alias.name, k)
            elif isinstance(child, ast.ImportFrom):
                assert child.level == 0, f"{path}: a relative import"
                for alias in child.names:
                    add(f"{child.module}.{alias.name}", k)
            visit(child, k)

    visit(ast.parse(path.read_text()), "top")
    return sorted(set(found))


def folder(module: str) -> str:
    return module.split(".")[0]


def allowed(importer: str, target: str) -> bool:
    """An allowed import into worker/, or a package above its module (whose __init__.py runs)."""
    return any(i == importer and (t == target or t.startswith(target + ".")) for i, t in ALLOWED_TO_WORKER)


def test_every_module_lives_in_a_process_folder() -> None:
    """The package's root holds only the console scripts' entry points (standard library only)."""
    loose = sorted(m for m in MODULES if m and "." not in m and m not in PROCESS_FOLDERS and m != "entry")
    assert loose == [], "each module belongs to front/, contract/ or worker/"
    folders = sorted(p.name for p in ROOT.iterdir() if p.is_dir() and p.name != "__pycache__")
    assert folders == sorted(PROCESS_FOLDERS)
    assert [name for name, kind in imports("entry") if kind != "lazy"] == [], "entry.py imports its command late"


def test_front_and_contract_never_import_torch_nor_the_worker() -> None:
    """Even inside a function: the server process runs its lazy imports too. What it may import of
    worker/ is listed, and is itself torch-free at import."""
    offenders = []
    for module in MODULES:
        if folder(module) not in ("front", "contract"):
            continue
        for target, kind in imports(module):
            if kind == "typing":
                continue
            if target in TORCH or (folder(target) == "worker" and not allowed(module, target)):
                offenders.append(f"{module} imports {target} ({kind})")
    for target in sorted({t for _, t in ALLOWED_TO_WORKER}):  # and what they import as they load
        seen, stack = set(), [target]
        while stack:
            module = stack.pop()
            for t, kind in imports(module):
                if kind == "top" and t not in seen:
                    seen.add(t)
                    if t in TORCH:
                        offenders.append(f"{target} (imported by the server process) reaches {t} through {module}")
                    else:
                        stack.append(t)
    assert offenders == []


def test_contract_never_imports_front() -> None:
    offenders = [
        f"{module} imports {target} ({kind})"
        for module in MODULES
        if folder(module) == "contract"
        for target, kind in imports(module)
        if folder(target) == "front"
    ]
    assert offenders == []


def test_the_worker_never_imports_front() -> None:
    offenders = [
        f"{module} imports {target} ({kind})"
        for module in MODULES
        if folder(module) == "worker"
        for target, kind in imports(module)
        if folder(target) == "front"
    ]
    assert offenders == []


def test_every_front_and_contract_module_imports_without_torch() -> None:
    """The same, as the interpreter sees it: every module of front/ and contract/ (and the listed worker
    modules they start) imported in one fresh interpreter (this test process imported torch long ago)."""
    names = sorted(m for m in MODULES if folder(m) in ("front", "contract")) + sorted({t for _, t in ALLOWED_TO_WORKER})
    code = (
        "import importlib, sys\n"
        f"for name in {names!r}:\n"
        f"    importlib.import_module('{PKG}.' + name)\n"
        "    loaded = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'triton'))\n"
        "    assert not loaded, (name, loaded[:5])\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr


def test_the_service_imports_the_generated_grpc_code_from_one_module() -> None:
    importers = sorted(
        str(p.relative_to(ROOT)) for p in ROOT.rglob("*.py") if "tokenmill_client._proto" in p.read_text()
    )
    assert importers == ["front/proto.py"]


def test_the_engine_layers_and_kernels_never_import_a_model_module() -> None:
    """Data flows engine -> model: the engine is written against a protocol (worker/engine/causal_lm.py),
    and layers and kernels know nothing of models."""
    offenders = [
        f"{module} imports {target}"
        for module in MODULES
        if module.startswith(("worker.engine", "worker.layers", "worker.kernels"))
        for target, _ in imports(module)
        if target.startswith("worker.models")
    ]
    assert offenders == []


def test_a_load_goes_one_way_down() -> None:
    """worker/plan/ decides and builds; the floors below it (engine, models, layers, kernels) take its
    answers as values and never call back up into it, and kernels take tensors, never layers."""
    below_the_plan = ("worker.engine", "worker.models", "worker.layers", "worker.kernels")
    climbs = [
        f"{module} imports {target} ({kind})"
        for module in MODULES
        if module.startswith(below_the_plan)
        for target, kind in imports(module)
        if target.startswith("worker.plan")
        or (module.startswith("worker.kernels") and target.startswith("worker.layers"))
    ]
    assert climbs == []
