"""Shared benchmark helpers: latency metrics as pure functions, synthetic prompts, and server processes
started on loopback and always stopped."""

from __future__ import annotations

import json
import logging
import math
import os
import random
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

logger = logging.getLogger(__name__)

# ---------------------------------------------------------------- metrics (pure functions)


@dataclass
class RequestRecord:
    """What the client saw of one request; times are time.perf_counter() seconds."""

    start: float
    end: float = 0.0
    ok: bool = False
    prompt_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0  # usage.prompt_tokens_details.cached_tokens, when the server reports it
    chunk_times: list[float] = field(default_factory=list)  # arrival of each chunk carrying text
    error: str | None = None

    @property
    def ttft(self) -> float | None:
        """Time to first token; a non-streamed request's first token arrives with its last."""
        if not self.ok:
            return None
        return (self.chunk_times[0] if self.chunk_times else self.end) - self.start

    @property
    def e2e(self) -> float | None:
        return self.end - self.start if self.ok else None

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first: (e2e - ttft) / (output_tokens - 1)."""
        if not self.ok or self.output_tokens < 2:
            return None
        assert self.ttft is not None and self.e2e is not None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)

    @property
    def itls(self) -> list[float]:
        """Gaps between consecutive streamed chunks (one chunk is usually one token)."""
        if not self.ok:
            return []
        times = self.chunk_times
        return [b - a for a, b in zip(times, times[1:], strict=False)]


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation between order statistics; NaN if empty."""
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile must be in [0, 100], got {q}")
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def summarize(values: Sequence[float], percentiles: Sequence[float] = (99,)) -> dict[str, float]:
    """mean, median and each requested percentile of `values` (seconds in, milliseconds out)."""
    ms = [v * 1000.0 for v in values]
    out = {"mean": sum(ms) / len(ms) if ms else math.nan, "median": percentile(ms, 50)}
    for q in percentiles:
        if q != 50:
            out[f"p{q:g}"] = percentile(ms, q)
    return out


def compute_metrics(
    records: Sequence[RequestRecord], duration: float, percentiles: Sequence[float] = (99,)
) -> dict[str, Any]:
    """Aggregate throughput and latency figures over a run that lasted `duration` seconds."""
    done = [r for r in records if r.ok]
    prompt_tokens = sum(r.prompt_tokens for r in done)
    output_tokens = sum(r.output_tokens for r in done)
    per_second = (lambda x: x / duration) if duration > 0 else (lambda x: math.nan)
    return {
        "completed": len(done),
        "failed": sum(1 for r in records if not r.ok and r.error != "cancelled"),
        "cancelled": sum(1 for r in records if r.error == "cancelled"),
        "duration_s": duration,
        "total_prompt_tokens": prompt_tokens,
        "total_output_tokens": output_tokens,
        "total_cached_tokens": sum(r.cached_tokens for r in done),
        "request_throughput": per_second(len(done)),
        "output_throughput": per_second(output_tokens),
        # also counts tokens streamed by requests the deadline cut off (a time-bounded slow server)
        "streamed_output_throughput": per_second(
            output_tokens + sum(len(r.chunk_times) for r in records if not r.ok)
        ),
        "total_token_throughput": per_second(prompt_tokens + output_tokens),
        "ttft_ms": summarize([r.ttft for r in done if r.ttft is not None], percentiles),
        "tpot_ms": summarize([r.tpot for r in done if r.tpot is not None], percentiles),
        "itl_ms": summarize([gap for r in done for gap in r.itls], percentiles),
        "e2e_ms": summarize([r.e2e for r in done if r.e2e is not None], percentiles),
        "errors": sorted({r.error for r in records if r.error and r.error != "cancelled"})[:5],
    }


def ratio(a: float, b: float) -> float:
    """a / b, NaN when either side is missing or b is zero."""
    if b == 0 or math.isnan(a) or math.isnan(b):
        return math.nan
    return a / b


# ---------------------------------------------------------------- synthetic prompts


class TextTokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


_WORDS = (
    "time year people way day man thing woman life child world school state family student group "
    "country problem hand part place case week company system program question work government "
    "number night point home water room mother area money story fact month lot right study book "
    "eye job word business issue side kind head house service friend father power hour game line "
    "end member law car city community name president team minute idea kid body information back "
    "parent face others level office door health person art war history party result change "
    "morning reason research girl guy moment air teacher force education river garden bright quiet "
    "simple large small early late young old green blue red strong open close read write walk run "
    "think build carry follow begin learn grow offer remember consider appear serve expect create"
).split()


class _HFTokenizer:
    def __init__(self, folder: Path) -> None:
        self._fast: Any
        self._auto: Any
        tokenizer_json = folder / "tokenizer.json"
        if tokenizer_json.is_file():
            from tokenizers import Tokenizer

            self._fast = Tokenizer.from_file(str(tokenizer_json))
            self._auto = None
        else:
            from transformers import AutoTokenizer

            self._fast = None
            self._auto = AutoTokenizer.from_pretrained(str(folder))

    def encode(self, text: str) -> list[int]:
        if self._fast is not None:
            return self._fast.encode(text, add_special_tokens=False).ids
        return self._auto.encode(text, add_special_tokens=False)

    def decode(self, ids: list[int]) -> str:
        if self._fast is not None:
            return self._fast.decode(ids)
        return self._auto.decode(ids)


def load_tokenizer(spec: str | None) -> TextTokenizer | None:
    """A tokenizer from a model folder; 'auto' tries kvserve's bundled model; None or 'none' -> None."""
    if spec in (None, "", "none"):
        return None
    if spec == "auto":
        try:
            from engine.models.loader import resolve_model

            return _HFTokenizer(resolve_model(None))
        except Exception as e:  # noqa: BLE001 - fall back to word counts, loudly
            logger.warning("no tokenizer (%s); approximating one token per word", e)
            return None
    folder = Path(spec).expanduser()
    if not folder.is_dir():
        raise ValueError(
            f"--tokenizer {spec!r} is not a folder; pass a model folder with tokenizer.json"
        )
    return _HFTokenizer(folder)


def synthetic_prompts(
    num_prompts: int, input_len: int, tokenizer: TextTokenizer | None, seed: int = 0
) -> list[str]:
    """Distinct prompts of random common words, `input_len` tokens long under `tokenizer`
    (or `input_len` words when there is none)."""
    if input_len < 1:
        raise ValueError("input length must be at least 1 token")
    rng = random.Random(seed)
    prompts = []
    for _ in range(num_prompts):
        words = [rng.choice(_WORDS) for _ in range(input_len * 2 if tokenizer else input_len)]
        text = " ".join(words)
        if tokenizer is not None:
            text = tokenizer.decode(tokenizer.encode(text)[:input_len])
        prompts.append(text)
    return prompts


# ---------------------------------------------------------------- server processes


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_get(url: str, timeout: float = 5.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:  # noqa: S310 - loopback URLs
            return resp.status, resp.read().decode("utf-8", "replace")
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode("utf-8", "replace")


def first_model_id(base_url: str) -> str | None:
    """The first model the server lists at /v1/models, or None if it lists none."""
    try:
        status, body = http_get(base_url.rstrip("/") + "/v1/models")
        if status == 200:
            data = json.loads(body).get("data") or []
            return data[0]["id"] if data else None
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return None


class ServerProcess:
    """A server subprocess in its own process group, logging to a file; use as a context manager."""

    def __init__(
        self, name: str, argv: list[str], port: int, log_dir: Path, env: dict | None = None
    ):
        self.name, self.argv, self.port = name, argv, port
        self.base_url = f"http://127.0.0.1:{port}"
        self.log_path = log_dir / f"{name}-{port}.log"
        self._env = {**os.environ, **(env or {})}
        self.proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> ServerProcess:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        logger.info("starting %s: %s (log %s)", self.name, " ".join(self.argv), self.log_path)
        log = self.log_path.open("wb")
        self.proc = subprocess.Popen(
            self.argv, stdout=log, stderr=subprocess.STDOUT, env=self._env, start_new_session=True
        )
        log.close()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def wait_healthy(self, timeout: float = 300.0, path: str = "/health") -> float:
        """Block until GET `path` answers 200; return the seconds it took. Fails fast if it exits."""
        assert self.proc is not None
        start = time.perf_counter()
        while time.perf_counter() - start < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"{self.name} exited with code {self.proc.returncode} before becoming healthy; "
                    f"log {self.log_path}:\n{self.log_tail()}"
                )
            try:
                if http_get(self.base_url + path, timeout=2.0)[0] == 200:
                    return time.perf_counter() - start
            except OSError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"{self.name} not healthy after {timeout:.0f}s; log {self.log_path}")

    def stop(self, grace: float = 15.0) -> None:
        """SIGTERM the server's process group, SIGKILL after `grace` seconds."""
        if self.proc is None or self.proc.poll() is not None:
            return
        pgid = self.proc.pid  # start_new_session: the server leads its own group
        for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(pgid, sig)
            except ProcessLookupError:
                return
            try:
                self.proc.wait(timeout=wait)
                return
            except subprocess.TimeoutExpired:
                continue
