"""What a GGUF file holds, for the llama.cpp side-by-side: its tensor types (a histogram, since
llama-quantize falls back to other types for rows it cannot split), the bytes a batch-1 decode step
reads from it, and the weight-streaming limit that puts on inter-token latency.

    python -m benchmarks.gguf_files FILE.gguf [FILE.gguf ...] [--context 192]
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

EMBEDDING = "token_embd.weight"
LM_HEAD = "output.weight"


@dataclass(frozen=True)
class TensorInfo:
    name: str
    type_name: str  # GGML type, e.g. Q4_K
    shape: tuple[int, ...]  # gguf-py order: the row (contiguous) width first
    num_bytes: int


@dataclass(frozen=True)
class DecodeBytes:
    weight_bytes: int  # every weight a decode step multiplies, the lm_head included
    kv_bytes_per_token: int  # K+V bytes of one context token, all layers (f16 cache)

    def per_token(self, context_len: int) -> float:
        return self.weight_bytes + self.kv_bytes_per_token * context_len


def read_tensors(path: str | Path) -> tuple[list[TensorInfo], dict[str, Any]]:
    """The file's tensors and its scalar metadata (arrays such as the vocabulary left out)."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    tensors = [
        TensorInfo(t.name, t.tensor_type.name, tuple(int(d) for d in t.shape), int(t.n_bytes))
        for t in reader.tensors
    ]
    meta: dict[str, Any] = {}
    for key, f in reader.fields.items():
        if f.types and f.types[0] != gguf.GGUFValueType.ARRAY:
            meta[key] = f.contents()
    return tensors, meta


def type_histogram(tensors: list[TensorInfo]) -> dict[str, tuple[int, int]]:
    """Type name -> (tensor count, bytes), most bytes first."""
    counts: Counter[str] = Counter()
    sizes: Counter[str] = Counter()
    for t in tensors:
        counts[t.type_name] += 1
        sizes[t.type_name] += t.num_bytes
    return {name: (counts[name], sizes[name]) for name, _ in sizes.most_common()}


def format_histogram(label: str, histogram: dict[str, tuple[int, int]]) -> str:
    total = sum(b for _, b in histogram.values()) or 1
    parts = [
        f"{name} x{count} ({b / 1e6:.1f} MB, {100 * b / total:.0f}%)"
        for name, (count, b) in histogram.items()
    ]
    return f"{label}: {total / 1e6:.1f} MB: " + ", ".join(parts)


def decode_bytes(tensors: list[TensorInfo], meta: dict[str, Any]) -> DecodeBytes:
    """Bytes one batch-1 decode step reads: every tensor once, except that the embedding table is
    only looked up (one row) when a separate lm_head exists; with tied embeddings it is the lm_head."""
    by_name = {t.name: t for t in tensors}
    weights = sum(t.num_bytes for t in tensors)
    embd = by_name.get(EMBEDDING)
    if embd is not None and LM_HEAD in by_name:
        rows = embd.shape[1] if len(embd.shape) > 1 else 1
        weights -= embd.num_bytes - embd.num_bytes // max(rows, 1)
    return DecodeBytes(weights, kv_bytes_per_token(meta))


def kv_bytes_per_token(meta: dict[str, Any]) -> int:
    """K+V bytes per context token of an f16 cache, from `<arch>.block_count` and head counts."""
    arch = str(meta.get("general.architecture", "llama"))
    layers = int(meta.get(f"{arch}.block_count", 0))
    heads = int(meta.get(f"{arch}.attention.head_count", 0))
    if not layers or not heads:
        return 0
    kv_heads = int(meta.get(f"{arch}.attention.head_count_kv", heads))
    width = int(meta.get(f"{arch}.embedding_length", 0))
    k_dim = int(meta.get(f"{arch}.attention.key_length", width // heads))
    v_dim = int(meta.get(f"{arch}.attention.value_length", k_dim))
    return layers * kv_heads * (k_dim + v_dim) * 2


def streaming_limit_ms(bytes_per_token: float, read_gbps: float) -> float:
    """The fastest a batch-1 decode step can be if it only has to stream its bytes once."""
    if read_gbps <= 0:
        raise ValueError("read bandwidth must be positive")
    return bytes_per_token / (read_gbps * 1e9) * 1e3


def describe(path: str | Path, context_len: int) -> dict[str, Any]:
    tensors, meta = read_tensors(path)
    cost = decode_bytes(tensors, meta)
    return {
        "file": str(path),
        "file_type": meta.get("general.file_type"),
        "histogram": type_histogram(tensors),
        "weight_bytes": cost.weight_bytes,
        "kv_bytes_per_token": cost.kv_bytes_per_token,
        "bytes_per_token": cost.per_token(context_len),
        "context_len": context_len,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("files", nargs="+")
    p.add_argument("--context", type=int, default=192, help="context for the KV bytes per token")
    args = p.parse_args(argv)
    for f in args.files:
        d = describe(f, args.context)
        print(format_histogram(Path(f).name, d["histogram"]))
        print(
            f"  decode reads {d['weight_bytes'] / 1e6:.1f} MB of weights + "
            f"{d['kv_bytes_per_token'] * args.context / 1e6:.1f} MB KV at context {args.context}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
