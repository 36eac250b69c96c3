"""The Docker image builds, runs as a non-root user, serves the baked-in model offline on port 8000 and
turns healthy by its own HEALTHCHECK; the compose file is accepted by `docker compose config`.

Runs only where a Docker engine answers (`docker info` succeeds); elsewhere it skips, saying why.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
import uuid
from collections.abc import Iterator

import httpx
import pytest

from tests.e2e.conftest import REPO_ROOT

BUILD_TIMEOUT_S = 3600
READY_TIMEOUT_S = 600


def _docker_unavailable() -> str | None:
    docker = shutil.which("docker")
    if docker is None:
        return "no docker CLI on PATH"
    try:
        info = subprocess.run([docker, "info"], capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        return "`docker info` timed out"
    if info.returncode != 0:
        lines = (info.stderr or info.stdout).strip().splitlines()
        reason = next(
            (line for line in lines if "daemon" in line.lower()), lines[-1] if lines else ""
        )
        return f"no Docker engine (`docker info` failed: {reason.strip()})"
    return None


_UNAVAILABLE = _docker_unavailable()
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(_UNAVAILABLE is not None, reason=_UNAVAILABLE or ""),
]


def _docker(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def image() -> Iterator[str]:
    tag = f"kvserve-test:{uuid.uuid4().hex[:12]}"
    built = _docker("build", "-t", tag, str(REPO_ROOT), timeout=BUILD_TIMEOUT_S)
    assert built.returncode == 0, built.stdout[-4000:] + built.stderr[-4000:]
    yield tag
    _docker("rmi", "-f", tag)


@pytest.fixture(scope="module")
def container(image: str) -> Iterator[tuple[str, str]]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    name = f"kvserve-test-{uuid.uuid4().hex[:12]}"
    run = _docker("run", "-d", "--name", name, "-p", f"127.0.0.1:{port}:8000", image)
    assert run.returncode == 0, run.stderr
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            state = _docker("inspect", "-f", "{{.State.Running}}", name).stdout.strip()
            assert state == "true", "container exited:\n" + _docker("logs", name).stdout[-4000:]
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(1)
        else:
            pytest.fail("no 200 from /health:\n" + _docker("logs", name).stdout[-4000:])
        yield name, url
    finally:
        _docker("rm", "-f", name)


def test_image_serves_the_baked_model_on_port_8000(container: tuple[str, str]) -> None:
    _, url = container
    models = httpx.get(url + "/v1/models", timeout=10).json()["data"]
    assert models and models[0]["id"]
    r = httpx.post(
        url + "/v1/completions",
        json={"model": models[0]["id"], "prompt": "Hello", "max_tokens": 3, "temperature": 0},
        timeout=120,
    )
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] >= 1


def test_image_runs_as_a_non_root_user(container: tuple[str, str]) -> None:
    name, _ = container
    uid = _docker("exec", name, "id", "-u")
    assert uid.returncode == 0 and uid.stdout.strip() not in ("", "0"), uid


def test_image_healthcheck_turns_healthy(container: tuple[str, str]) -> None:
    name, _ = container
    deadline = time.monotonic() + 180  # start period, then one 15 s interval per probe
    status = ""
    while time.monotonic() < deadline:
        status = _docker("inspect", "-f", "{{.State.Health.Status}}", name).stdout.strip()
        if status == "healthy":
            return
        assert status in ("starting", ""), status
        time.sleep(2)
    pytest.fail(f"HEALTHCHECK status {status!r} after 180 s")


def test_compose_file_is_accepted_by_docker_compose() -> None:
    if _docker("compose", "version").returncode != 0:
        pytest.skip("the docker compose plugin is not installed")
    result = _docker("compose", "-f", str(REPO_ROOT / "docker-compose.yml"), "config", "--quiet")
    assert result.returncode == 0, result.stderr
