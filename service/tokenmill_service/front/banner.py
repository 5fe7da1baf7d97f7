"""What a person who just ran `make run` sees once the server is ready: commands to copy and paste.

`--banner auto` (the server's default) shows it on a terminal only, so a log collector gets the
structured `server_ready` line alone; `make run` passes `--banner on`, so it shows whatever its output
is piped to. The commands name the real paths of the tools (`.venv/bin/tokenmill-client`,
`.tools/bin/grpcurl`) when they are there, so they work as pasted from the repository's root.
"""

from __future__ import annotations

import sys
from pathlib import Path

from tokenmill_service.contract.config import Settings


def _tool(path: Path, fallback: str) -> str:
    """`path` relative to the working directory when it is there and below it, else the bare name."""
    if not path.exists():
        return fallback
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def _client_path() -> str:
    # The client script sits beside this interpreter (the virtual environment's bin/).
    return _tool(Path(sys.executable).parent / "tokenmill-client", "tokenmill-client")


def ready_banner(settings: Settings, model: str) -> str:
    host = "localhost" if settings.host in ("0.0.0.0", "::", "") else settings.host
    address = f"{host}:{settings.port}"
    client = f"{_client_path()} --server {address}"
    grpcurl = _tool(Path.cwd() / ".tools" / "bin" / "grpcurl", "grpcurl")
    # Each example asks for a few tokens, not the server's default length.
    request = '{"prompt": "Hello", "stopping": {"max_new_tokens": 16}}'
    lines = [
        "",
        f"tokenmill is ready: {model}, gRPC on {address}"
        + (f", OpenAI-compatible HTTP on http://{host}:{settings.http_port}/v1" if settings.http_port else ""),
        "",
        f'  {client} generate -l 32 "What is the capital of France?"',
        f"  {client} generate -i",
        f"  {grpcurl} -plaintext -d '{request}' {address} tokenmill.v1.Generation/Generate",
    ]
    if settings.http_port:
        body = '{"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 32, "stream": true}'
        lines.append(
            f"  curl -N http://{host}:{settings.http_port}/v1/chat/completions"
            f" -H 'Content-Type: application/json' -d '{body}'"
        )
    if grpcurl == "grpcurl":  # not installed under .tools/bin
        lines.append("  (grpcurl: `make tools` installs it under .tools/bin; or github.com/fullstorydev/grpcurl)")
    lines.append(
        "  (other ports: make run PORT=50052 HTTP_PORT=8001, or tokenmill-server --port 50052 --http-port 8001)"
    )
    lines += ["", "Ctrl-C stops the server.", ""]
    return "\n".join(lines) + "\n"


def show_ready_banner(settings: Settings, model: str) -> None:
    if settings.banner == "on" or (settings.banner == "auto" and sys.stderr.isatty()):
        sys.stderr.write(ready_banner(settings, model))
        sys.stderr.flush()
