"""TLS: the server serves gRPC over TLS with a certificate written by the test; the client and the
CLI connect with the CA file; a plaintext client is refused. Bearer tokens from a file, several."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from tests.server_process import ServerProcess
from tokenmill_client import Client

CLI = Path(sys.executable).parent / "tokenmill-client"


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("tls")
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=localhost",
         "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1",
         "-keyout", str(d / "key.pem"), "-out", str(d / "cert.pem")],
        check=True, capture_output=True, timeout=60,
    )  # fmt: skip
    (d / "tokens").write_text("# rotated monthly\nold-token\nnew-token\n")
    return d


@pytest.fixture(scope="module")
def tls_server(certs: Path) -> Iterator[ServerProcess]:
    proc = ServerProcess(
        "--tls-cert", str(certs / "cert.pem"), "--tls-key", str(certs / "key.pem"),
        "--auth-token-file", str(certs / "tokens"), "--health-port", "0",
    )  # fmt: skip
    # The readiness poll in ServerProcess speaks plaintext: give it a health-only plaintext port.
    from tests.server_process import free_port

    health = free_port()
    proc.args[proc.args.index("--health-port") + 1] = str(health)
    proc.address, tls_address = f"127.0.0.1:{health}", proc.address
    proc.start()
    proc.address = tls_address
    yield proc
    proc.stop()


def test_the_client_connects_over_tls_with_the_ca_file_and_either_token(tls_server: ServerProcess, certs: Path) -> None:
    for token in ("old-token", "new-token"):
        with Client(tls_server.address, root_certificates=certs / "cert.pem", token=token, timeout=60) as client:
            assert client.generate_text("Hello", max_new_tokens=2).usage.completion_tokens == 2
    with (
        Client(tls_server.address, root_certificates=certs / "cert.pem", token="wrong", timeout=60) as client,
        pytest.raises(Exception, match="token"),
    ):
        client.generate_text("Hello", max_new_tokens=2)


def test_the_cli_connects_with_tls_and_a_ca_file(tls_server: ServerProcess, certs: Path) -> None:
    result = subprocess.run(
        [str(CLI), "--server", tls_server.address, "--tls", "--tls-ca", str(certs / "cert.pem"),
         "--token", "new-token", "generate", "-p", "Hello", "--limit", "2"],
        capture_output=True, text=True, timeout=120, env=os.environ, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr


def test_a_plaintext_client_is_refused(tls_server: ServerProcess) -> None:
    with grpc.insecure_channel(tls_server.address) as channel:
        call = channel.unary_unary("/tokenmill.v1.Generation/GetModelInfo")
        with pytest.raises(grpc.RpcError) as err:
            call(b"", timeout=10, metadata=[("authorization", "Bearer new-token")])
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
