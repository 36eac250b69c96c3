"""KV offload tiers through a real server: a prompt evicted from a 14-block pool comes back from the
host tier (usage's cached tokens, the cost sheet's tier tokens, the same greedy text), Prometheus
counts the tier's hits and fill, and a restart with the same --kv-offload-dir serves it from disk."""

from __future__ import annotations

import random
import re
from pathlib import Path

import httpx

from tests.e2e.conftest import ServerProcess

ARGS = (
    "--device cpu --dtype float32 --quantization none --max-model-len 256 --num-kv-blocks 14 "
    "--max-num-seqs 4 --log-level warning"
).split()
REUSABLE = 144  # 9 full blocks of a 160-token prompt (its last token is always computed)


def _prompts() -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(100, 40000) for _ in range(160)] for _ in range(3)]


def _complete(server: ServerProcess, prompt: list[int]) -> dict:
    body = {
        "prompt": prompt,
        "max_tokens": 8,
        "temperature": 0,
        "ignore_eos": True,
        "return_metrics": True,
    }
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def _cached(resp: dict) -> int:
    details = resp["usage"].get("prompt_tokens_details") or {}
    return details.get("cached_tokens") or 0


def _metric(server: ServerProcess, name: str, tier: str) -> float:
    text = httpx.get(server.url + "/metrics", timeout=10).text
    match = re.search(rf'^{name}{{tier="{tier}"}} (\S+)$', text, re.M)
    assert match is not None, f"{name} missing"
    return float(match.group(1))


def test_tiers_through_the_server_and_a_restart(tiny_llama_dir: Path, tmp_path: Path) -> None:
    tier_args = [
        *ARGS,
        "--kv-offload-memory",
        "16MiB",
        "--kv-offload-dir",
        str(tmp_path / "kv"),
    ]
    prompts = _prompts()
    server = ServerProcess(tiny_llama_dir, tier_args, tmp_path / "first.log")
    try:
        server.wait_ready()
        first = [_complete(server, p) for p in prompts]  # each evicts the one before it
        assert all(_cached(r) == 0 for r in first)
        again = _complete(server, prompts[0])
        assert again["choices"][0]["text"] == first[0]["choices"][0]["text"]
        assert _cached(again) == REUSABLE
        assert again["metrics"]["num_memory_tier_tokens"] == REUSABLE
        assert again["metrics"]["num_disk_tier_tokens"] == 0
        assert _metric(server, "kvserve_kv_offload_hits_total", "memory") == REUSABLE // 16
        assert _metric(server, "kvserve_kv_offload_used_bytes", "memory") > 0
        assert _metric(server, "kvserve_kv_offload_used_bytes", "disk") > 0
    finally:
        assert server.stop() == 0
    restarted = ServerProcess(tiny_llama_dir, tier_args, tmp_path / "second.log")
    try:
        restarted.wait_ready()
        out = _complete(restarted, prompts[1])  # evicted wholly by the two requests after it
        assert out["choices"][0]["text"] == first[1]["choices"][0]["text"]
        assert _cached(out) == REUSABLE
        assert out["metrics"]["num_disk_tier_tokens"] == REUSABLE
        assert _metric(restarted, "kvserve_kv_offload_hits_total", "disk") == REUSABLE // 16
    finally:
        restarted.stop()
