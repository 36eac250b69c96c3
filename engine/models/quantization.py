"""Quantization of a loaded model's matmul weights into block formats (engine.models.block_quant):
int8 = Q8_0 blocks everywhere; int4 = Q4_1 blocks in the layers and Q8_0 for the head; gguf = the
blocks a GGUF file stores, exactly. Also the one `linear` every model layer calls."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from engine.models.block_quant import (
    BlockQ4Weight,
    BlockQ8Weight,
    BlockWeight,
    quantize_q4_1,
    quantize_q8_0,
)

if TYPE_CHECKING:
    from engine.models.block_parts import BlockParts
    from engine.models.gguf_blocks import StoredValues
    from engine.models.kquant import BlockKWeight

logger = logging.getLogger(__name__)

QUANTIZATIONS = ("int8", "int4", "gguf")


def linear(
    x: torch.Tensor,
    weight: torch.Tensor | BlockWeight | BlockKWeight | BlockParts,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """F.linear for a plain [out, in] weight, or the block kernel for a quantized one."""
    if isinstance(weight, torch.Tensor):
        return F.linear(x, weight, bias)
    out = weight.matmul(x)
    return out if bias is None else out + bias


class BlockEmbedding(nn.Module):
    """Embedding lookups dequantized from the Q8_0 head tied to the embedding (one int8 table)."""

    def __init__(self, head: BlockQ8Weight, dtype: torch.dtype) -> None:
        super().__init__()
        self.head = head
        self.dtype = dtype
        self.num_embeddings, self.embedding_dim = head.out_features, head.in_features

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # [n] -> [n, hidden]
        rows = self.head.rows(ids)
        return rows if self.dtype == torch.float32 else rows.to(self.dtype)


def _from_float(weight: torch.Tensor, kind: str) -> BlockWeight:
    if kind == "q4_1":
        return BlockQ4Weight(quantize_q4_1(weight))
    return BlockQ8Weight(quantize_q8_0(weight))


@torch.no_grad()
def quantize_model(model: nn.Module, method: str | None, gguf_file: Path | None = None) -> int:
    """Replace the model's matmul weights (`model.quantizable_weights()`) by block weights, in
    place; `gguf` takes the blocks stored in `gguf_file` wherever they dequantize exactly to the
    loaded weights (Q8_0 elsewhere). Returns the bytes the weights now take."""
    if method is None:
        return weight_bytes(model)
    if method not in QUANTIZATIONS:
        raise ValueError(f"quantization must be int8, int4 or gguf; got {method!r}")
    device = next(model.parameters()).device
    if device.type != "cpu":
        raise ValueError(
            f"--quantization {method} uses CPU kernels; on {device} serve bf16/fp16 weights "
            "(--quantization none)"
        )
    find_weights = getattr(type(model), "quantizable_weights", None)
    if find_weights is None:
        raise ValueError(f"--quantization is not supported for {type(model).__name__} models")
    stored = _stored_blocks(model, gguf_file) if method == "gguf" else {}
    before = weight_bytes(model)
    names = {id(module): name for name, module in model.named_modules()}
    kept = 0
    for owner, attr in find_weights(model):
        weight = getattr(owner, attr)
        name = f"{names[id(owner)]}.{attr}".lstrip(".")
        head = attr == "lm_head_weight"
        if name in stored:
            packed = stored[name].to_weight()
            kept += 1
        elif weight.shape[1] % 32:
            continue  # no whole blocks: this weight stays float
        else:
            packed = _from_float(weight.data, "q4_1" if method == "int4" and not head else "q8_0")
        if attr in owner._parameters:
            del owner._parameters[attr]
        setattr(owner, attr, packed)
    _share_head_with_embedding(model)
    changed = getattr(model, "weights_changed", None)
    if changed is not None:
        changed()
    after = weight_bytes(model)
    detail = f", {kept} weights as stored in {gguf_file.name}" if gguf_file and stored else ""
    logger.info(
        "quantized matmul weights (%s%s): %.0f MB -> %.0f MB",
        method,
        detail,
        before / 1e6,
        after / 1e6,
    )
    return after


# Bumped whenever a block format's kernel numerics change (what a served weight computes).
BLOCK_NUMERICS_VERSION = 2  # 2: K-quants served as stored (were Q8_0 from floats)


def served_formats(model: nn.Module) -> str:
    """Which block format serves each matmul weight, as a short key: two loads whose KV could
    differ (a K-quant file served as Q8_0 before, as stored now) get different keys. For caches
    of computed values keyed by model identity (KV offload tiers)."""
    import hashlib

    h = hashlib.blake2b(digest_size=8, person=b"kvserve-wfmt")
    h.update(str(BLOCK_NUMERICS_VERSION).encode())
    for name, module in model.named_modules():
        kind = getattr(module, "kind", None)
        if isinstance(kind, str) and hasattr(module, "matmul"):  # a block weight
            h.update(f"{name}={kind};".encode())
    return h.hexdigest()


def _stored_blocks(model: nn.Module, gguf_file: Path | None) -> dict[str, StoredValues]:
    """The GGUF file's blocks for the weights they reproduce exactly (checked one by one)."""
    from engine.models.gguf_blocks import matches_float, read_block_weights

    if gguf_file is None:
        raise ValueError(
            "--quantization gguf serves a GGUF file's stored blocks: pass a .gguf model"
        )
    model.quantizable_weights()  # type: ignore[operator]  # ties the head to the embedding
    blocks = read_block_weights(gguf_file, model)
    current = dict(model.named_parameters(remove_duplicate=False))
    current["lm_head_weight"] = getattr(model, "lm_head_weight", None)  # type: ignore[assignment]
    exact = {}
    for name, values in blocks.items():
        weight = current.get(name)
        if weight is not None and matches_float(values, weight):
            exact[name] = values
        else:
            logger.warning("%s: GGUF blocks differ from the loaded weight; requantizing it", name)
    return exact


def _share_head_with_embedding(model: nn.Module) -> None:
    """A head tied to the embedding and packed as Q8_0: lookups then dequantize rows of the same
    table (no float copy of the table stays in memory)."""
    head = getattr(model, "lm_head_weight", None)
    if getattr(model, "tie_word_embeddings", False) and isinstance(head, BlockQ8Weight):
        dtype = getattr(model, "dtype", torch.float32)
        model.embed_tokens = BlockEmbedding(head, dtype)


def weight_bytes(model: nn.Module) -> int:
    """Bytes of every distinct parameter and buffer of `model` (block weights included)."""
    seen: dict[int, torch.Tensor] = {}
    for t in [*model.parameters(), *model.buffers()]:
        seen[id(t)] = t
    return sum(t.numel() * t.element_size() for t in seen.values())
