"""Generate the Python code for the public API protos into the client package.

    python scripts/gen_proto.py          # regenerate client/tokenmill_client/_proto/
    python scripts/gen_proto.py --check  # regenerate into a temp dir; exit 1 if the committed files differ

protoc lays files out by proto package (tokenmill/v1/generate_pb2.py) and the gRPC plugin imports
siblings absolutely (``from tokenmill.v1 import generate_pb2``), which would need ``tokenmill`` on
sys.path. This script flattens the output into ``tokenmill_client._proto`` and rewrites those imports
to package-relative ones (``from . import generate_pb2``), so the generated code imports as part of
the installed client package. The output depends only on the protos and the grpcio-tools version.
"""

from __future__ import annotations

import argparse
import difflib
import re
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PROTO_ROOT = REPO / "protos"
PROTO_PACKAGE_DIR = Path("tokenmill") / "v1"
OUT_DIR = REPO / "client" / "tokenmill_client" / "_proto"
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")

# ``from tokenmill.v1 import generate_pb2 as tokenmill_dot_v1_dot_generate__pb2``
_ABSOLUTE_IMPORT = re.compile(r"^from tokenmill\.v1 import (\w+_pb2)\b", re.MULTILINE)
# ``import tokenmill.v1.generate_pb2`` (not emitted today; rejected so a change in protoc is noticed)
_PLAIN_IMPORT = re.compile(r"^import tokenmill\.", re.MULTILINE)


def _is_generated(path: Path) -> bool:
    return path.name.endswith(GENERATED_SUFFIXES)


def _rewrite(source: str, name: str) -> str:
    if _PLAIN_IMPORT.search(source):
        raise SystemExit(f"gen_proto: {name}: unexpected absolute import form; update _rewrite()")
    return _ABSOLUTE_IMPORT.sub(r"from . import \1", source)


def generate() -> dict[str, str]:
    """Run protoc on every proto under protos/tokenmill/v1; return {file name: rewritten text}."""
    protos = sorted(str(p.relative_to(PROTO_ROOT)) for p in (PROTO_ROOT / PROTO_PACKAGE_DIR).glob("*.proto"))
    if not protos:
        raise SystemExit(f"gen_proto: no .proto files under {PROTO_ROOT / PROTO_PACKAGE_DIR}")
    with tempfile.TemporaryDirectory(prefix="tokenmill-proto-") as tmp:
        cmd = [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            f"-I{PROTO_ROOT}",
            f"--python_out={tmp}",
            f"--pyi_out={tmp}",
            f"--grpc_python_out={tmp}",
            *protos,
        ]
        proc = subprocess.run(cmd, check=False, cwd=REPO, capture_output=True, text=True)
        if proc.returncode != 0:
            sys.stderr.write(proc.stderr)
            raise SystemExit(f"gen_proto: protoc failed with exit code {proc.returncode}")
        out: dict[str, str] = {}
        for path in sorted((Path(tmp) / PROTO_PACKAGE_DIR).iterdir()):
            if _is_generated(path):
                out[path.name] = _rewrite(path.read_text(encoding="utf-8"), path.name)
    return out


def committed() -> dict[str, str]:
    if not OUT_DIR.is_dir():
        return {}
    return {p.name: p.read_text(encoding="utf-8") for p in sorted(OUT_DIR.iterdir()) if _is_generated(p)}


def check(fresh: dict[str, str]) -> int:
    current = committed()
    stale = False
    for name in sorted(set(fresh) | set(current)):
        want, have = fresh.get(name), current.get(name)
        if want == have:
            continue
        stale = True
        if have is None:
            sys.stderr.write(f"missing: {OUT_DIR / name}\n")
        elif want is None:
            sys.stderr.write(f"no longer generated (delete it): {OUT_DIR / name}\n")
        else:
            diff = difflib.unified_diff(
                have.splitlines(keepends=True),
                want.splitlines(keepends=True),
                fromfile=f"committed/{name}",
                tofile=f"generated/{name}",
                n=1,
            )
            sys.stderr.writelines(list(diff)[:40])
    if stale:
        sys.stderr.write("generated proto code is out of date: run `python scripts/gen_proto.py`\n")
        return 1
    sys.stdout.write(f"generated proto code is up to date ({len(fresh)} files in {OUT_DIR.relative_to(REPO)})\n")
    return 0


def write(fresh: dict[str, str]) -> int:
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    for name in set(committed()) - set(fresh):
        (OUT_DIR / name).unlink()
    for name, text in fresh.items():
        (OUT_DIR / name).write_text(text, encoding="utf-8")
    sys.stdout.write(f"wrote {len(fresh)} files to {OUT_DIR.relative_to(REPO)}\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the committed generated code is stale")
    args = parser.parse_args(argv)
    fresh = generate()
    return check(fresh) if args.check else write(fresh)


if __name__ == "__main__":
    raise SystemExit(main())
