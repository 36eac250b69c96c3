"""Optional C++ CPU kernels (csrc/), compiled once per torch version into the kvserve cache by the
installer (`python -m engine.kernels.cpu_kernels`) or on first use; pure-torch code is the fallback
wherever the build is not possible (no compiler), so every code path still runs."""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)

_CSRC = Path(__file__).with_name("csrc")
_SOURCES = tuple(
    _CSRC / name
    for name in (
        "paged_decode.cpp",
        "paged_prefill.cpp",
        "attention_bf16.cpp",
        "block_matmul.cpp",
        "block_matmul_avx2.cpp",
        "block_matmul_vnni.cpp",
        "block_kquants.cpp",
        "block_q5.cpp",
        "block_paths.cpp",
        "decode_layer.cpp",
        "silu_mul.cpp",
        "first_argmax.cpp",
    )
)
_HEADERS = (
    _CSRC / "block_matmul.h",
    _CSRC / "attention_avx2.h",
    _CSRC / "attention_bf16.h",
    _CSRC / "attention_bf16_kernels.inc",
    _CSRC / "child_probe.h",
    _CSRC / "layer_rows.h",
    _CSRC / "block_linear.h",
)
_DISABLE_ENV = "KVSERVE_CPU_KERNELS"  # "0" turns the C++ kernels off (pure-torch paths only)


def cache_dir() -> Path:
    env = os.environ.get("KVSERVE_CACHE_DIR")  # the same cache as converted models
    root = Path(env).expanduser() if env else Path.home() / ".cache" / "kvserve"
    return root / "cpu_kernels"


def library_path() -> Path:
    """Where this source, built against this torch and Python, lives: rebuilt when either changes."""
    key = hashlib.sha256()
    for source in (*_SOURCES, *_HEADERS):
        key.update(source.read_bytes())
    key.update(f"{torch.__version__}|{sys.version_info[:2]}|{sysconfig.get_platform()}".encode())
    return cache_dir() / f"kvserve_cpu_{key.hexdigest()[:16]}.so"


def build(force: bool = False) -> Path:
    """Compile the kernels into the cache (an atomic rename, so concurrent builders are safe)."""
    target = library_path()
    if target.exists() and not force:
        return target
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        raise RuntimeError("no C++ compiler (c++ or g++) found")
    from torch.utils import cpp_extension

    target.parent.mkdir(parents=True, exist_ok=True)
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    # No FMA contraction: the fused elementwise kernels must round exactly as torch's ops do.
    cmd = [compiler, "-O3", "-std=c++20", "-shared", "-fPIC", "-fopenmp", "-ffp-contract=off"]
    cmd += [str(source) for source in _SOURCES]
    cmd += [f"-D_GLIBCXX_USE_CXX11_ABI={abi}"]
    cmd += [f"-I{p}" for p in cpp_extension.include_paths()]
    cmd += [f"-L{p}" for p in cpp_extension.library_paths()]
    cmd += ["-lc10", "-ltorch_cpu", "-ltorch"]
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        result = subprocess.run([*cmd, "-o", tmp], capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"compiling the C++ CPU kernels failed:\n{result.stderr[-4000:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


@functools.cache
def available() -> bool:
    """Load the kernels (building them if needed) once; False, with the reason logged, if not."""
    if os.environ.get(_DISABLE_ENV, "1") == "0":
        logger.info("C++ CPU kernels disabled by %s=0; using the pure-torch paths", _DISABLE_ENV)
        return False
    try:
        path = library_path()
        if not path.exists():
            logger.info("building the C++ CPU kernels (once per torch version) ...")
            path = build()
        torch.ops.load_library(str(path))
    except (RuntimeError, OSError) as e:
        logger.warning("C++ CPU kernels unavailable, using the pure-torch paths: %s", e)
        return False
    return True


def paged_decode_attention(
    q: torch.Tensor,  # [B, heads, d]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, kv_heads, d]
    block_tables: torch.Tensor,  # [>= B, width] int32
    seq_lens: torch.Tensor,  # [>= B] int32
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:  # [B, heads, d]
    """Each query over its sequence's context (the last `window` positions of it when set), scores
    softcapped when `softcap` is set."""
    return torch.ops.kvserve.paged_decode_attention(
        q, kv_cache, block_tables, seq_lens, scale, window or 0, softcap or 0.0
    )


def paged_prefill_attention(
    q: torch.Tensor,  # [num_tokens, heads, d]: each sequence's new tokens, sequence by sequence
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, kv_heads, d]
    block_tables: torch.Tensor,  # [>= num_seqs, width] int32
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32: context length after the step
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:  # [num_tokens, heads, d]
    """Every new token over its own causal context (the last query_len positions of its sequence's
    seq_len), bitwise what paged_decode_attention gives that token alone, with key/value tiles
    shared by a chunk's rows (csrc/paged_prefill.cpp)."""
    return torch.ops.kvserve.paged_prefill_attention(
        q, kv_cache, block_tables, query_start_loc, seq_lens, scale, window or 0, softcap or 0.0
    )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * rms-normalized x, x [n, hidden], in one pass per row."""
    return torch.ops.kvserve.rms_norm(x, weight, eps)


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(x[:, :inter]) * x[:, inter:] for x [n, 2 * inter] float32, in one pass per row."""
    return torch.ops.kvserve.silu_mul(x)


def first_argmax(x: torch.Tensor, portable: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """x.max(dim=-1) of x [rows, n] float32 (NaN counts as the maximum, ties keep the first index)
    in one vectorized pass per row; portable=True: the element-by-element path."""
    values, indices = torch.ops.kvserve.first_argmax(x, portable)
    return values, indices


def rope_write_kv(
    qkv: torch.Tensor,  # [n, (heads + 2 * kv_heads) * d], rotated in place
    cos: torch.Tensor,  # [n, d // 2]
    sin: torch.Tensor,
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, kv_heads, d]
    slot_mapping: torch.Tensor,  # [n] int64
    heads: int,
    kv_heads: int,
) -> None:
    """Rotary on q and k inside the fused qkv, then k and v stored at their cache slots."""
    torch.ops.kvserve.rope_write_kv(qkv, cos, sin, kv_cache, slot_mapping, heads, kv_heads)


def decode_plan(
    weights: list[torch.Tensor],  # every layer's decode_layer weights, layer after layer
    counts: list[int],  # per layer: its number of weights, then of kinds
    kinds: list[int],  # every layer's decode_layer kinds, layer after layer
    floats: list[float],  # per layer: eps, scale, softcap (0: off)
    ints: list[int],  # per layer: heads, KV heads, window (0: off)
) -> Any:  # torch.classes.kvserve.DecodePlan
    """decode_layers' per-model arguments, held on the C++ side (built once per model)."""
    return torch.classes.kvserve.DecodePlan(weights, counts, kinds, floats, ints)


def decode_layers(
    h: torch.Tensor,  # [n, hidden]
    plan: Any,  # decode_plan's
    kv_caches: list[torch.Tensor],  # per layer
    shared: list[torch.Tensor],  # per set: cos, sin, slot_mapping, block_tables, seq_lens
    where: list[int],  # per layer: which set of `shared` it reads
) -> torch.Tensor:  # [n, hidden]
    """Every decoder layer of a step in one call: decode_layer's ops, layer by layer (no LoRA)."""
    return _decode_layers_op()(h, plan, kv_caches, shared, where)


@functools.cache
def _decode_layers_op() -> Callable[..., torch.Tensor]:
    """decode_layers' C++ entry. An op taking a torchbind object (the plan) is a
    TorchBindOpOverload, whose Python __call__ first walks every argument for fake script objects
    (torch.compile's stand-ins; never here, the plan is real): ~25-40 us a step over the KV cache
    list. The overload's own C++ callable (`_op`, what that __call__ ends in) skips the walk."""
    overload = torch.ops.kvserve.decode_layers.default
    return getattr(overload, "_op", overload)


def decode_layer(
    h: torch.Tensor,  # [n, hidden]
    weights: list[torch.Tensor],  # the layer's norms and matmul tensors, see csrc/decode_layer.cpp
    kinds: list[int],
    eps: float,
    cos: torch.Tensor,  # [n, d // 2]
    sin: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    heads: int,
    kv_heads: int,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
    lora: tuple[list[torch.Tensor], list[int]] | None = None,
) -> torch.Tensor:  # [n, hidden]
    """One decoder layer of a pure decode step in one call (the fused layer's exact ops).
    `lora`: the step's LoRA deltas for this layer, (tensors, segments) as
    engine.models.lora_apply.one_call_args builds them (see csrc/decode_layer.cpp)."""
    if lora is not None:
        return torch.ops.kvserve.decode_layer_lora(
            h, weights, kinds, eps, cos, sin, kv_cache, slot_mapping, block_tables, seq_lens,
            heads, kv_heads, scale, window or 0, softcap or 0.0, lora[0], lora[1],
        )  # fmt: skip
    return torch.ops.kvserve.decode_layer(
        h, weights, kinds, eps, cos, sin, kv_cache, slot_mapping, block_tables, seq_lens,
        heads, kv_heads, scale, window or 0, softcap or 0.0,
    )  # fmt: skip


def main() -> int:
    """Build the kernels now (the installer calls this); exit status 0 even without a compiler."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        path = build(force="--force" in sys.argv)
    except RuntimeError as e:
        logger.warning(
            "kvserve: C++ CPU kernels not built (%s); the pure-torch paths will be used", e
        )
        return 0
    torch.ops.load_library(str(path))
    logger.info("kvserve: C++ CPU kernels ready at %s", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
