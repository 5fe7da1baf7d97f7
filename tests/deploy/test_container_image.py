"""The container image: the repository's Dockerfile built with a daemonless builder (buildah, from Debian's
packages), the image run, and a request served by it.

Skipped, with the reason, where the machine cannot build images: no buildah; no base image (where no
container registry is reachable, a Python base is made from Debian's packages with mmdebstrap); no torch
index (the Dockerfile's CPU index, download.pytorch.org, or TOKENMILL_TEST_TORCH_WHEEL: a local CPU torch
wheel, served with its dependencies from PyPI as a local index). Minutes of downloads and compilation: run
it on purpose, ``pytest tests/deploy/test_container_image.py``.

- TOKENMILL_TEST_PYTHON_IMAGE: a Python 3.11 image to build on (default: python:3.11-slim when the registry
  answers, else one made here from Debian bookworm).
- TOKENMILL_TEST_TORCH_INDEX_URL / TOKENMILL_TEST_TORCH_WHEEL: where torch comes from (see above).
"""

from __future__ import annotations

import contextlib
import http.server
import os
import shutil
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.server_process import free_port
from tokenmill_client import Client, FinishReason, HealthStatus, TokenmillError

pytestmark = [pytest.mark.slow, pytest.mark.timeout(3600)]

REPO = Path(__file__).resolve().parents[2]
IMAGE = "localhost/tokenmill-image-test:latest"
RUNTIME = "localhost/runtime-cpu:latest"  # the Dockerfile's stage name: see image()
BASE = "localhost/tokenmill-image-test-base:bookworm"
DOCKERFILE_TORCH_INDEX = "https://download.pytorch.org/whl/cpu"
# What the Dockerfile's build needs of a base: Python 3.11 with venv and pip, `python` and `pip` on PATH.
BASE_PACKAGES = "python3,python3-venv,python3-pip,python-is-python3,ca-certificates"
# A site's own TLS trust (an intercepting proxy's CA): the base gets the host's, so pip and apt reach out.
HOST_CAS = Path("/usr/local/share/ca-certificates")
HOST_PIP_CONF = Path("/etc/pip.conf")


def buildah(*args: str, timeout: float = 1800, check: bool = True) -> subprocess.CompletedProcess[str]:
    # vfs: works as root inside a container, where overlay mounts may not.
    return subprocess.run(
        ["buildah", "--storage-driver", "vfs", *args], capture_output=True, text=True, timeout=timeout, check=check
    )


def reachable(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=10):
            return True
    except OSError:
        return False


def base_image(tmp: Path) -> str:
    """A Python 3.11 image: the given one, python:3.11-slim when the registry answers, else made from Debian."""
    given = os.environ.get("TOKENMILL_TEST_PYTHON_IMAGE")
    if given:
        return given
    if reachable("https://registry-1.docker.io/v2/"):
        return "docker.io/library/python:3.11-slim"
    if buildah("images", "--quiet", BASE, check=False).returncode == 0:
        return BASE  # made by an earlier run
    if shutil.which("mmdebstrap") is None:
        pytest.skip(
            "no container registry is reachable and mmdebstrap is not installed to make a base from Debian's "
            "packages (apt-get install mmdebstrap, or set TOKENMILL_TEST_PYTHON_IMAGE)"
        )
    rootfs = tmp / "base.tar"
    subprocess.run(
        ["mmdebstrap", "--variant=apt", f"--include={BASE_PACKAGES}", "bookworm", str(rootfs)],
        check=True,
        capture_output=True,
        timeout=1800,
    )
    ctr = buildah("from", "scratch").stdout.strip()
    try:
        mount = buildah("mount", ctr).stdout.strip()
        subprocess.run(["tar", "-x", "-C", mount, "-f", str(rootfs)], check=True, timeout=600)
        buildah("umount", ctr)
        if HOST_CAS.is_dir() and any(HOST_CAS.iterdir()):
            buildah("copy", ctr, f"{HOST_CAS}/", f"{HOST_CAS}/")
            buildah("run", "--isolation", "chroot", ctr, "--", "update-ca-certificates")
        if HOST_PIP_CONF.is_file():
            buildah("copy", ctr, str(HOST_PIP_CONF), str(HOST_PIP_CONF))
        buildah("commit", "--quiet", ctr, BASE)
    finally:
        buildah("rm", ctr, check=False)
    return BASE


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        pass


def torch_source() -> str:
    """Where the image's torch comes from: an index URL, or a local wheel's path (skips when there is none)."""
    given = os.environ.get("TOKENMILL_TEST_TORCH_INDEX_URL")
    if given:
        return given
    if reachable(DOCKERFILE_TORCH_INDEX + "/"):
        return DOCKERFILE_TORCH_INDEX
    wheel = os.environ.get("TOKENMILL_TEST_TORCH_WHEEL")
    if not wheel:
        pytest.skip(
            f"the Dockerfile's torch index ({DOCKERFILE_TORCH_INDEX}) is not reachable; set "
            "TOKENMILL_TEST_TORCH_WHEEL to a CPU torch wheel for Python 3.11 (or TOKENMILL_TEST_TORCH_INDEX_URL)"
        )
    return wheel


@contextlib.contextmanager
def torch_index(source: str, tmp: Path) -> Iterator[str]:
    """``source`` when it is an index; around a wheel, a local index of it and its dependencies from PyPI."""
    if "://" in source:
        yield source
        return
    wheel = source
    # A PEP 503 index of directories, as http.server lists them: the wheel and its dependencies from PyPI.
    files = tmp / "wheels"
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--quiet", "--only-binary=:all:", "--python-version", "3.11",
         "--platform", "manylinux_2_28_x86_64", "--platform", "any", "--dest", str(files), wheel],
        check=True,
        capture_output=True,
        timeout=900,
    )  # fmt: skip
    for file in files.glob("*.whl"):
        project = file.name.split("-")[0].lower().replace("_", "-").replace(".", "-")
        (tmp / "simple" / project).mkdir(parents=True, exist_ok=True)
        shutil.copy(file, tmp / "simple" / project / file.name)
    port = free_port()
    handler = lambda *a: _Quiet(*a, directory=str(tmp))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", port), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{port}/simple"  # the build's RUN steps share the host's network (chroot)
    finally:
        server.shutdown()


@pytest.fixture(scope="module")
def image(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    if shutil.which("buildah") is None:
        reason = "buildah is not installed (Debian: apt-get install buildah)"
        if shutil.which("podman"):
            reason += "; podman is, but this test drives buildah"
        pytest.skip(reason)
    source = torch_source()  # the cheap checks first: a base from Debian takes minutes
    tmp = tmp_path_factory.mktemp("image")
    base = base_image(tmp)
    context = tmp / "context"
    context.mkdir()
    archive = subprocess.run(["git", "-C", str(REPO), "archive", "HEAD"], capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", str(context)], input=archive.stdout, check=True)
    with torch_index(source, tmp) as index:
        args = ["--isolation", "chroot", "--pull=missing", "--layers=false", "--format", "docker"]  # HEALTHCHECK
        args += ["--build-arg", f"PYTHON_IMAGE={base}", "--build-arg", f"TORCH_INDEX_URL={index}"]
        # buildah 1.28 (Debian 12) does not expand the ARG in `FROM runtime-${VARIANT}` when it picks the
        # stages to build: it skips runtime-cpu, then looks for an image of that name. So that stage is built
        # first, as an image of that name, which the whole build then starts its final stage from.
        for step in (["--target", "runtime-cpu", "-t", RUNTIME], ["-t", IMAGE]):
            build = buildah("bud", *args, *step, str(context), timeout=3000, check=False)
            assert build.returncode == 0, build.stdout[-4000:] + build.stderr[-4000:]
    yield IMAGE
    buildah("rmi", IMAGE, RUNTIME, check=False)


def test_the_image_builds_runs_and_serves_a_request(image: str) -> None:
    ctr = buildah("from", "--pull=never", image).stdout.strip()
    port, http_port = free_port(), free_port()
    # The image's own command line, on free ports of the host's network (chroot isolation shares it).
    run = subprocess.Popen(
        ["buildah", "--storage-driver", "vfs", "run", "--isolation", "chroot", ctr, "--", "tokenmill-server",
         "--host", "127.0.0.1", "--port", str(port), "--http-port", str(http_port), "--metrics-port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )  # fmt: skip
    try:
        with Client(f"127.0.0.1:{port}", timeout=60) as client:
            deadline = time.monotonic() + 900
            while True:
                try:
                    if client.health(timeout=5) is HealthStatus.SERVING:
                        break
                except TokenmillError:
                    pass
                assert run.poll() is None, run.stdout.read() if run.stdout else ""
                assert time.monotonic() < deadline, "the server in the image did not become SERVING"
                time.sleep(2)
            result = client.generate_text(messages=[("user", "Hello")], max_new_tokens=4)
            plan = client.model_info().load_plan
        # The kernels the image built as root load for its user (they once were private files, and every
        # step fell back to the reference ops).
        assert not [v for v in plan.values() if "cannot open shared object" in v], plan
        assert result.usage.completion_tokens >= 1 and result.finish_reason in (FinishReason.LENGTH, FinishReason.EOS)
        with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/v1/models", timeout=30) as resp:
            assert resp.status == 200
    finally:
        run.terminate()
        try:
            run.wait(60)
        except subprocess.TimeoutExpired:
            run.kill()
        buildah("rm", ctr, check=False)
