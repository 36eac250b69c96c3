"""Embeddings/s of kvserve's EmbeddingModel (packed, no padding) against transformers' AutoModel run
directly on the same texts (padded batch, masked mean pooling, normalize): both figures and the ratio.

    python -m benchmarks.embed_bench [--model DIR] [--batch-size 64] [--dtype float32] [--device auto]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

WORDS = (
    "the a model text vector server token batch quick brown fox jumps over lazy dog river bank "
    "paris capital france language attention layer mean pooling embedding search query document "
    "retrieval 2024 café naïve 東京 данные 🙂 ! ? , ."
).split()


def make_texts(count: int, min_words: int, max_words: int, seed: int) -> list[str]:
    """Deterministic texts of mixed lengths, as a real embedding workload has."""
    rng = random.Random(seed)
    return [
        " ".join(rng.choice(WORDS) for _ in range(rng.randint(min_words, max_words)))
        for _ in range(count)
    ]


def time_both(
    fns: list[Callable[[], torch.Tensor]], iters: int, warmup: int, device: torch.device
) -> list[float]:
    """Median seconds per call of each function; calls alternate so that load from other processes
    on a shared machine hits both sides alike."""
    times: list[list[float]] = [[] for _ in fns]
    for i in range(warmup + iters):
        for fn, record in zip(fns, times, strict=True):
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            fn()
            if device.type == "cuda":
                torch.cuda.synchronize()
            if i >= warmup:
                record.append(time.perf_counter() - start)
    return [statistics.median(record) for record in times]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="HF folder; default: the bundled MiniLM")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--min-words", type=int, default=3)
    parser.add_argument("--max-words", type=int, default=120)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--device", default="auto")
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--json", action="store_true", help="also print one JSON line")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.threads:
        torch.set_num_threads(args.threads)

    from transformers import AutoModel, AutoTokenizer

    from engine.embeddings.embedding_model import EmbeddingModel
    from engine.models.loader import find_bundled_embedding_model, resolve_device

    model_dir = Path(args.model) if args.model else find_bundled_embedding_model()
    device = resolve_device(args.device)
    dtype = getattr(torch, args.dtype)
    ours = EmbeddingModel.load(model_dir, dtype=args.dtype, device=str(device))
    if not ours.is_encoder or ours.pooling != "mean":
        print("this benchmark compares mean-pooled encoders only", file=sys.stderr)
        return 2
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    reference = AutoModel.from_pretrained(model_dir, dtype=dtype).to(device).eval()

    texts = make_texts(args.batch_size, args.min_words, args.max_words, args.seed)
    encoded = tokenizer(texts, truncation=True, max_length=ours.max_model_len)
    token_ids: list[list[int]] = encoded["input_ids"]
    padded = tokenizer(
        texts, truncation=True, max_length=ours.max_model_len, padding=True, return_tensors="pt"
    ).to(device)
    lengths = [len(ids) for ids in token_ids]

    @torch.inference_mode()
    def run_transformers() -> torch.Tensor:
        hidden = reference(**padded).last_hidden_state  # [batch, max_len, hidden]
        mask = padded["attention_mask"].unsqueeze(-1).to(hidden.dtype)  # [batch, max_len, 1]
        pooled = (hidden * mask).sum(1).float() / mask.sum(1).float()
        return F.normalize(pooled, dim=-1)

    def run_kvserve() -> torch.Tensor:
        return ours.embed(token_ids)

    agreement = F.cosine_similarity(run_kvserve().double(), run_transformers().cpu().double()).min()
    t_ours, t_ref = time_both([run_kvserve, run_transformers], args.iters, args.warmup, device)
    ours_rate, ref_rate = args.batch_size / t_ours, args.batch_size / t_ref
    print(
        f"model {model_dir.parent.name}/{model_dir.name} on {device} {args.dtype}, threads {torch.get_num_threads()}; "
        f"batch {args.batch_size}, tokens {sum(lengths)} (min {min(lengths)}, max {max(lengths)}, "
        f"padded {len(lengths) * max(lengths)})"
    )
    print(f"kvserve EmbeddingModel : {ours_rate:10.1f} embeddings/s  ({t_ours * 1e3:.1f} ms/batch)")
    print(f"transformers AutoModel : {ref_rate:10.1f} embeddings/s  ({t_ref * 1e3:.1f} ms/batch)")
    print(f"ratio kvserve/transformers: {ours_rate / ref_rate:.2f}x   min cosine {agreement:.6f}")
    if args.json:
        record = {
            "device": str(device),
            "dtype": args.dtype,
            "batch_size": args.batch_size,
            "tokens": sum(lengths),
            "kvserve_embeddings_per_s": ours_rate,
            "transformers_embeddings_per_s": ref_rate,
            "ratio": ours_rate / ref_rate,
            "min_cosine": float(agreement),
        }
        print(json.dumps(record))
    return 0


if __name__ == "__main__":
    sys.exit(main())
