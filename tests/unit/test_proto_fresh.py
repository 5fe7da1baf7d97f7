"""The committed generated code in tokenmill_client._proto matches protos/ (scripts/gen_proto.py --check)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_committed_generated_proto_code_is_up_to_date() -> None:
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "gen_proto.py"), "--check"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_generated_code_imports_as_part_of_the_client_package() -> None:
    from tokenmill_client._proto import generate_pb2, generate_pb2_grpc

    assert generate_pb2.DESCRIPTOR.package == "tokenmill.v1"
    # The _grpc module's import was rewritten to the package-relative one: it shares the same module.
    assert generate_pb2_grpc.tokenmill_dot_v1_dot_generate__pb2 is generate_pb2
    assert "tokenmill.v1" not in sys.modules
    service = generate_pb2.DESCRIPTOR.services_by_name["Generation"]
    assert [m.name for m in service.methods] == [
        "Generate",
        "Tokenize",
        "GetModelInfo",
        "LoadLoRAAdapter",
        "UnloadLoRAAdapter",
    ]
