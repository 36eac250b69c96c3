"""Real `python -m server serve` processes on free ports, shared per session, plus client helpers:
a module's own server (`running_server`) and the ports of a server that publishes KV events."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import pytest

if TYPE_CHECKING:
    from tests.kv_event_subscriber import Subscriber

REPO_ROOT = Path(__file__).resolve().parents[2]
STARTUP_TIMEOUT_S = 300


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ServerProcess:
    """A kvserve server subprocess; `url` is its base (no /v1)."""

    def __init__(
        self, model: Path | str, args: list[str], log_path: Path, env: dict[str, str] | None = None
    ):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        cmd = [sys.executable, "-m", "server", "serve", str(model), "--port", str(self.port), *args]
        full_env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", **(env or {})}
        self._log = open(log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            cmd, cwd=REPO_ROOT, env=full_env, stdout=self._log, stderr=subprocess.STDOUT
        )

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, headers: dict[str, str] | None = None) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        saw_503 = False
        self.startup_statuses: list[int] = []  # every /health status seen while starting
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"server exited with {self.proc.returncode}:\n{self.log()[-4000:]}"
                )
            try:
                r = httpx.get(self.url + "/health", timeout=2)
                self.startup_statuses.append(r.status_code)
                if r.status_code == 200:
                    self.saw_loading_503 = saw_503
                    return
                saw_503 |= r.status_code == 503
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        self.stop()
        raise RuntimeError(f"server not ready after {STARTUP_TIMEOUT_S}s:\n{self.log()[-4000:]}")

    def stats(self, headers: dict[str, str] | None = None) -> dict:
        return httpx.get(self.url + "/v1/internal/stats", headers=headers, timeout=10).json()

    def wait_idle(self, headers: dict[str, str] | None = None, timeout: float = 60) -> dict:
        """Poll until no request runs or waits and every KV block is free again."""
        deadline = time.monotonic() + timeout
        stats: dict = {}
        while time.monotonic() < deadline:
            stats = self.stats(headers)
            if (
                stats["num_running"] == 0
                and stats["num_waiting"] == 0
                and stats["num_free_blocks"] == stats["num_total_blocks"]
            ):
                return stats
            time.sleep(0.1)
        raise AssertionError(f"engine not idle: {stats}")

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


@contextlib.contextmanager
def running_server(
    model: Path | str, args: list[str], log_path: Path, env: dict[str, str] | None = None
) -> Iterator[ServerProcess]:
    """A server started and ready for the block, stopped after it (also when it failed to start)."""
    server = ServerProcess(model, args, log_path, env)
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


@dataclass(frozen=True)
class KVEventPorts:
    """The local ports a server publishes its KV events on (ZMQ) and answers replays on."""

    events: int
    replay: int

    def server_args(self, **config: Any) -> list[str]:
        """`--kv-events-config` publishing on these ports, plus `config`'s fields (a topic, ...)."""
        events = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://*:{self.events}",
            "replay_endpoint": f"tcp://*:{self.replay}",
            **config,
        }
        return ["--kv-events-config", json.dumps(events)]

    def subscriber(self, topic: str = "") -> Subscriber:
        """A subscriber of these ports (the caller closes it); zmq loads only when one is made."""
        from tests.kv_event_subscriber import Subscriber

        return Subscriber(
            f"tcp://127.0.0.1:{self.events}", f"tcp://127.0.0.1:{self.replay}", topic=topic
        )


@pytest.fixture(scope="module")
def kv_event_ports() -> KVEventPorts:
    return KVEventPorts(free_port(), free_port())


# Small pool and budgets keep the tiny model fast on CPU; block size 16 x 64 blocks = 1024 tokens.
TINY_ARGS = [
    "--device", "cpu", "--dtype", "float32", "--max-model-len", "256", "--num-kv-blocks", "64",
    "--max-num-seqs", "16", "--max-num-batched-tokens", "512", "--log-level", "warning",
]  # fmt: skip


@pytest.fixture(scope="session")
def tiny_server(
    tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    server = ServerProcess(tiny_llama_dir, TINY_ARGS, tmp_path_factory.mktemp("logs") / "tiny.log")
    server.wait_ready()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def smol_server(
    smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    # No --dtype: the default a user gets (auto = the converted checkpoint's float32 on CPU).
    args = ["--device", "cpu", "--max-model-len", "1024", "--num-kv-blocks", "128",
            "--served-model-name", "smol", "--log-level", "warning"]  # fmt: skip
    server = ServerProcess(smollm2_dir, args, tmp_path_factory.mktemp("logs") / "smol.log")
    server.wait_ready()
    yield server
    server.stop()
