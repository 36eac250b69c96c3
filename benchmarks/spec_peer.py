"""Speculative decoding against llama.cpp's (issue #26): on the input-grounded prompts of
benchmarks/spec_decode.py (rewrite, quote, code edit), concurrency 1, streamed chat completions,
greedy: llama-server plain, llama-server with its speculative types (n-gram lookups, a draft model),
kvserve plain and kvserve with `--speculative-config` (ngram, suffix), all on the same GGUF file and
thread count, started side by side and taking turns request by request (the order rotating each
round). Prints per variant the median time per output token after the first (decode seconds /
(tokens - 1), as spec_decode.py measures ITL), its ratio to the same server's plain decoding and to
llama.cpp's plain, TTFT, llama.cpp's draft acceptance, and whether the greedy text matched the same
server without speculation. Benchmark-only: llama.cpp is never built in the tests or CI.

    python -m benchmarks.spec_peer --llama-server $LLAMA_DIR/build/bin/llama-server \\
        [--gguf FILE] [--draft $LLAMA_DIR/models/SmolLM2-135M-Instruct-first8-Q8_0.gguf] \\
        [--rounds 2] [--max-tokens 128] [--threads 2]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import shlex
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.bench_utils import ServerProcess, cpu_summary, free_port

logger = logging.getLogger(__name__)

K = 5  # kvserve's proposal length, as in spec_decode.py
KVSERVE_SPEC = {
    "ngram": {
        "method": "ngram",
        "num_speculative_tokens": K,
        "prompt_lookup_min": 2,
        "prompt_lookup_max": 4,
    },
    "suffix": {"method": "suffix", "num_speculative_tokens": K},
}
# llama-server's speculative types in the vendored version (`--spec-type`, see its --help)
LLAMA_SPEC = {
    "ngram-simple": "--spec-type ngram-simple --spec-ngram-simple-size-n 4 "
    "--spec-ngram-simple-size-m 8",
    "ngram-mod": "--spec-type ngram-mod",
    "ngram-map-k": "--spec-type ngram-map-k",
}
DRAFT_ARGS = "--spec-draft-n-max 8 --spec-draft-n-min 0"


@dataclass(frozen=True)
class Variant:
    name: str  # "llama.cpp ngram-mod", "kvserve suffix"
    server: str  # "llama.cpp" or "kvserve": which plain variant it is compared with
    argv: list[str]

    @property
    def plain(self) -> bool:
        return self.name.endswith(" plain")


@dataclass
class Tally:
    tpot_ms: list[float] = field(default_factory=list)
    ttft_ms: list[float] = field(default_factory=list)
    texts: dict[tuple[int, int], str] = field(default_factory=dict)  # (round, prompt) -> text
    draft_n: int = 0
    draft_accepted: int = 0


def variants(args: argparse.Namespace) -> list[Variant]:
    t = str(args.threads)
    llama = [args.llama_server, "-m", args.gguf, "--host", "127.0.0.1", "--port", "0"]
    llama += ["--parallel", "1", "--ctx-size", "4096", "--threads", t, "--threads-batch", t]
    kv = [sys.executable, "-m", "server", "serve", args.gguf, "--host", "127.0.0.1"]
    kv += ["--port", "0", "--threads", t]
    out = [Variant("llama.cpp plain", "llama.cpp", llama)]
    for name in args.llama_spec:
        out.append(Variant(f"llama.cpp {name}", "llama.cpp", llama + shlex.split(LLAMA_SPEC[name])))
    if args.draft:
        draft = ["-md", args.draft, *shlex.split(DRAFT_ARGS)]
        out.append(Variant("llama.cpp draft", "llama.cpp", llama + draft))
    out.append(Variant("kvserve plain", "kvserve", kv))
    for name in args.kvserve_spec:
        config = json.dumps(KVSERVE_SPEC[name])
        out.append(Variant(f"kvserve {name}", "kvserve", kv + ["--speculative-config", config]))
    return out


def chat_once(url: str, prompt: str, max_tokens: int) -> dict[str, Any]:
    """One streamed greedy chat completion: TTFT, time per token after the first, text, tokens."""
    import httpx

    body = {
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    first = last = math.nan
    text, tokens = "", 0
    timings: dict[str, Any] = {}
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices") or []:
                piece = (choice.get("delta") or {}).get("content") or ""
                if piece:
                    now = time.perf_counter()
                    first = now if math.isnan(first) else first
                    last, text = now, text + piece
            if chunk.get("usage"):
                tokens = int(chunk["usage"].get("completion_tokens") or 0)
            timings = chunk.get("timings") or timings  # llama-server: draft_n, draft_n_accepted
    tpot = (last - first) / (tokens - 1) * 1e3 if tokens > 1 else math.nan
    return {
        "ttft_ms": (first - start) * 1e3,
        "tpot_ms": tpot,
        "text": text,
        "tokens": tokens,
        "draft_n": int(timings.get("draft_n") or 0),
        "draft_accepted": int(timings.get("draft_n_accepted") or 0),
    }


def rotation(names: list[str], rnd: int) -> list[str]:
    """Who goes first moves by one each round, so no variant always runs on a fresh machine."""
    k = rnd % len(names) if names else 0
    return names[k:] + names[:k]


def summarize(tallies: dict[str, Tally], servers: dict[str, str]) -> list[dict[str, Any]]:
    """Per variant: median TPOT and TTFT, ratios to its server's plain and to llama.cpp plain,
    acceptance, and how many greedy texts equal the same server's plain text."""
    med = {n: statistics.median(t.tpot_ms) if t.tpot_ms else math.nan for n, t in tallies.items()}
    rows = []
    for name, t in tallies.items():
        plain = f"{servers[name]} plain"
        plain_texts = tallies[plain].texts if plain in tallies else {}
        same = sum(1 for key, text in t.texts.items() if plain_texts.get(key) == text)
        rows.append(
            {
                "variant": name,
                "tpot_ms": med[name],
                "ttft_ms": statistics.median(t.ttft_ms) if t.ttft_ms else math.nan,
                "vs_own_plain": _ratio(med[name], med.get(plain, math.nan)),
                "vs_llama_plain": _ratio(med[name], med.get("llama.cpp plain", math.nan)),
                "acceptance": t.draft_accepted / t.draft_n if t.draft_n else math.nan,
                "same_text": f"{same}/{len(t.texts)}",
            }
        )
    return rows


def _ratio(a: float, b: float) -> float:
    return a / b if b and not (math.isnan(a) or math.isnan(b)) else math.nan


def format_rows(rows: list[dict[str, Any]]) -> str:
    head = f"{'variant':<24}{'ms/token':>9}{'x plain':>9}{'x llama':>9}{'TTFT ms':>9}"
    lines = [head + f"{'accept':>8}  same text as plain"]
    for r in rows:
        acc = "n/a" if math.isnan(r["acceptance"]) else f"{100 * r['acceptance']:.0f}%"
        lines.append(
            f"{r['variant']:<24}{r['tpot_ms']:>9.2f}{r['vs_own_plain']:>9.2f}"
            f"{r['vs_llama_plain']:>9.2f}{r['ttft_ms']:>9.0f}{acc:>8}  {r['same_text']}"
        )
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--llama-server", required=True, help="a llama.cpp `llama-server` binary")
    p.add_argument("--gguf", default=None, help="default: the bundled SmolLM2 Q4_1 GGUF")
    p.add_argument("--draft", default=None, help="draft GGUF (same tokenizer) for llama.cpp -md")
    p.add_argument("--llama-spec", nargs="*", default=list(LLAMA_SPEC), choices=list(LLAMA_SPEC))
    p.add_argument(
        "--kvserve-spec", nargs="*", default=list(KVSERVE_SPEC), choices=list(KVSERVE_SPEC)
    )
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--startup-timeout", type=float, default=600.0)
    p.add_argument("--log-dir", default=None)
    p.add_argument("--json-out", default=None)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    from benchmarks.spec_decode import GROUNDED  # the spec helper's prompt set

    if args.gguf is None:
        from engine.models.loader import find_bundled_model

        args.gguf = str(find_bundled_model())
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="kvserve-spec-peer-"))
    vs = variants(args)
    tallies = {v.name: Tally() for v in vs}
    with contextlib.ExitStack() as stack:
        urls = {}
        for v in vs:  # all idle quietly: started once, side by side
            port = free_port()
            argv = list(v.argv)
            argv[argv.index("--port") + 1] = str(port)
            name = v.name.replace(" ", "-")
            server = stack.enter_context(ServerProcess(name, argv, port, log_dir))
            try:
                logger.info(
                    "%s healthy after %.0fs", v.name, server.wait_healthy(args.startup_timeout)
                )
            except RuntimeError as e:
                logger.error("%s did not start: %s", v.name, e)
                continue
            urls[v.name] = server.base_url
        for url in urls.values():  # warm-up
            chat_once(url, GROUNDED[0], 8)
        for rnd in range(args.rounds):
            for i, prompt in enumerate(GROUNDED):
                for name in rotation(list(urls), rnd * len(GROUNDED) + i):
                    r = chat_once(urls[name], prompt, args.max_tokens)
                    t = tallies[name]
                    t.tpot_ms.append(r["tpot_ms"])
                    t.ttft_ms.append(r["ttft_ms"])
                    t.texts[(rnd, i)] = r["text"]
                    t.draft_n += r["draft_n"]
                    t.draft_accepted += r["draft_accepted"]
                    logger.info("%s: %d tokens, %.2f ms/token", name, r["tokens"], r["tpot_ms"])
    servers = {v.name: v.server for v in vs}
    rows = summarize({n: t for n, t in tallies.items() if n in urls}, servers)
    print(f"\ngrounded prompts x{len(GROUNDED)}, c=1, max_tokens {args.max_tokens}, greedy, ")
    print(f"{args.rounds} rounds, {args.threads} threads each, file {args.gguf}")
    print(format_rows(rows))
    print(cpu_summary())
    if args.json_out:
        Path(args.json_out).write_text(
            json.dumps({"rows": rows, "argv": {v.name: v.argv for v in vs}}, indent=2)
        )
    return 0 if len(urls) == len(vs) else 1


if __name__ == "__main__":
    sys.exit(main())
