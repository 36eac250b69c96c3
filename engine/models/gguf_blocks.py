"""A GGUF file's quantized tensors (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, and the K-quants Q4_K, Q5_K,
Q6_K) as kvserve's block weights, exactly as stored: llama.cpp's tensor
names (per `general.architecture`) mapped to the model's fused matmul weights, its rotary row order
for q/k undone where its converter applies one (the llama arch only), and every mapped weight checked
against the float weights the model loaded (the same file, dequantized)."""

from __future__ import annotations

import logging
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import torch

from engine.models.block_parts import PartsValues
from engine.models.block_q5 import Q5_BLOCK_BYTES, from_gguf_q5blocks
from engine.models.block_quant import GGUF_BLOCK_BYTES, BlockValues, from_gguf_blocks
from engine.models.kquant import KQUANT_BLOCK_BYTES, SUPER, KValues, from_gguf_kblocks

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class GGUFArch:
    """How llama.cpp lays out one architecture's per-layer matmuls."""

    layer_parts: dict[str, tuple[str, int]]  # llama.cpp name -> (our weight, its part, fused order)
    unpermute_qk: bool  # llama.cpp's converter reordered q/k rows for its rotary (llama only)
    # 3-D tensors of all experts ([experts, rows, cols]) -> (each expert's weight, its part)
    expert_parts: dict[str, tuple[str, int]] = field(default_factory=dict)

    def num_parts(self, name: str) -> int:
        """How many llama.cpp tensors fill our weight `name` (`layers.N.<weight>`)."""
        if ".experts." in name:
            suffix = name.rsplit(".", 1)[-1]
            return sum(1 for weight, _ in self.expert_parts.values() if weight == suffix)
        ours = name.split(".", 2)[-1] if name.startswith("layers.") else ""
        return max(1, sum(1 for weight, _ in self.layer_parts.values() if weight == ours))


_SEPARATE = {  # q, k, v and gate, up stored apart: fused here in this order
    "attn_q": ("self_attn.qkv_weight", 0),
    "attn_k": ("self_attn.qkv_weight", 1),
    "attn_v": ("self_attn.qkv_weight", 2),
    "attn_output": ("self_attn.o_weight", 0),
    "ffn_gate": ("mlp.gate_up_weight", 0),
    "ffn_up": ("mlp.gate_up_weight", 1),
    "ffn_down": ("mlp.down_weight", 0),
}
_FUSED = {  # Phi-3's checkpoint fuses them (qkv_proj, gate_up_proj); llama.cpp keeps them fused
    "attn_qkv": ("self_attn.qkv_weight", 0),
    "attn_output": ("self_attn.o_weight", 0),
    "ffn_up": ("mlp.gate_up_weight", 0),
    "ffn_down": ("mlp.down_weight", 0),
}
# The architectures served as stored, by GGUF `general.architecture`; others are requantized from
# the float weights transformers dequantized. Only llama.cpp's llama arch permutes q/k: qwen2,
# qwen3, phi3, gemma3 and qwen3moe write the checkpoint's rows as they are (q/k norms, biases and
# rope factors are float tensors).
_EXPERTS = {  # Qwen3-MoE's experts, one tensor per matrix kind (ffn_gate_inp, the router, is float)
    "ffn_gate_exps": ("gate_up_weight", 0),
    "ffn_up_exps": ("gate_up_weight", 1),
    "ffn_down_exps": ("down_weight", 0),
}
GGUF_ARCHS = {
    "llama": GGUFArch(_SEPARATE, unpermute_qk=True),
    "qwen2": GGUFArch(_SEPARATE, unpermute_qk=False),
    "qwen3": GGUFArch(_SEPARATE, unpermute_qk=False),
    "phi3": GGUFArch(_FUSED, unpermute_qk=False),
    "gemma3": GGUFArch(_SEPARATE, unpermute_qk=False),  # its norms (stored as 1 + w) are floats
    "qwen3moe": GGUFArch(_SEPARATE, unpermute_qk=False, expert_parts=_EXPERTS),
}


def _unpermute_rows(rows: int, heads: int) -> torch.Tensor:
    """Row order that undoes llama.cpp's q/k permutation (its rotary pairs adjacent values; the HF
    layout pairs the two halves of each head): HF row h*d + t*(d/2) + i is GGUF row h*d + 2i + t."""
    half = rows // heads // 2
    gguf = torch.arange(rows).view(heads, half, 2)  # [head, i, t]
    return gguf.transpose(1, 2).reshape(rows)  # [head, t, i] in HF order


StoredValues = BlockValues | KValues | PartsValues


def _stored(kind: str, raw: np.ndarray, shape: tuple[int, int]) -> BlockValues | KValues:
    if kind in KQUANT_BLOCK_BYTES:
        return from_gguf_kblocks(kind, raw, shape)
    if kind in Q5_BLOCK_BYTES:
        return from_gguf_q5blocks(kind, raw, shape)
    return from_gguf_blocks(kind, raw, shape)


def _tensor_bytes(kind: str, values: int) -> int:
    if kind in KQUANT_BLOCK_BYTES:
        return values // SUPER * KQUANT_BLOCK_BYTES[kind]
    return values // 32 * {**GGUF_BLOCK_BYTES, **Q5_BLOCK_BYTES}[kind]


def read_block_weights(path: Path, model: Any) -> dict[str, StoredValues]:
    """Our matmul weight name (as in model.named_parameters / quantizable_weights) -> its stored
    blocks, for every weight all of whose GGUF parts are in a block format kvserve runs directly
    (parts in different formats each keep their own). Weights missing here (float or other GGUF
    types) are quantized from the float weights."""
    arch_name, tensors = read_gguf_index(path)
    arch = GGUF_ARCHS.get(arch_name or "")
    if arch is None:
        logger.info(
            "GGUF architecture %r: serving its weights requantized, not as stored", arch_name
        )
        return {}
    data = np.memmap(path, dtype=np.uint8, mode="r")
    parts: dict[str, dict[int, BlockValues | KValues]] = {}
    for tensor in tensors:
        kind = _GGUF_TYPES.get(tensor.type_id)
        if kind is None or len(tensor.shape) not in (2, 3):
            continue
        k, n = tensor.shape[:2]  # GGUF lists the fastest dimension first
        experts = tensor.shape[2] if len(tensor.shape) == 3 else 1
        name, part = _our_name(tensor.name, model, arch)
        whole = SUPER if kind in KQUANT_BLOCK_BYTES else 32
        if name is None or k % whole or ("{}" in name) != (len(tensor.shape) == 3):
            continue
        raw = data[tensor.offset : tensor.offset + _tensor_bytes(kind, experts * n * k)]
        values = _stored(kind, raw, (experts * n, k))  # experts one after another
        if len(tensor.shape) == 3:  # `name` is a pattern with the expert's index to fill in
            for e in range(experts):
                rows = values.rows(torch.arange(e * n, (e + 1) * n))
                parts.setdefault(name.format(e), {})[part] = rows
            continue
        if arch.unpermute_qk and tensor.name.endswith(("attn_q.weight", "attn_k.weight")):
            heads = model.num_heads if "attn_q" in tensor.name else model.num_kv_heads
            values = values.rows(_unpermute_rows(n, heads))
        parts.setdefault(name, {})[part] = values
    found: dict[str, StoredValues] = {}
    for name, by_part in parts.items():
        want = arch.num_parts(name)
        if sorted(by_part) != list(range(want)):
            continue  # a part in a float or other GGUF type: packed from the floats
        found[name] = _fuse([by_part[i] for i in range(want)])
    return found


def _fuse(ordered: list[BlockValues | KValues]) -> StoredValues:
    """One weight from its parts: blocks of one format concatenated, else runs of equal formats
    side by side (e.g. Q6_K attn_v beside Q4_K attn_q/k: each part's own kernel)."""
    runs: list[list[BlockValues | KValues]] = []
    for values in ordered:
        if runs and runs[-1][0].kind == values.kind:
            runs[-1].append(values)
        else:
            runs.append([values])
    fused: list[BlockValues | KValues] = [type(run[0]).cat(run) for run in runs]  # type: ignore[arg-type]
    return fused[0] if len(fused) == 1 else PartsValues(list(fused))


def _our_name(gguf_name: str, model: Any, arch: GGUFArch) -> tuple[str | None, int]:
    if gguf_name == "token_embd.weight":
        return ("lm_head_weight" if model.tie_word_embeddings else None), 0
    if gguf_name == "output.weight":
        return ("lm_head_weight" if not model.tie_word_embeddings else None), 0
    pieces = gguf_name.split(".")
    if len(pieces) != 4 or pieces[0] != "blk" or pieces[3] != "weight":
        return None, 0
    if pieces[2] in arch.expert_parts:  # one name per expert: "{}" is its index
        ours, part = arch.expert_parts[pieces[2]]
        return f"layers.{int(pieces[1])}.mlp.experts.{{}}.{ours}", part
    if pieces[2] in arch.layer_parts:
        ours, part = arch.layer_parts[pieces[2]]
        return f"layers.{int(pieces[1])}.{ours}", part
    return None, 0


# The ggml type ids of the formats run as stored.
_GGUF_TYPES = {
    2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K"
}  # fmt: skip


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    shape: tuple[int, ...]  # fastest-varying dimension first, as GGUF stores it
    type_id: int
    offset: int  # absolute byte offset of its data in the file


# GGUF metadata value types: fixed sizes (struct formats), 8 = string, 9 = array
_SCALARS = {
    0: "B",
    1: "b",
    2: "H",
    3: "h",
    4: "I",
    5: "i",
    6: "f",
    7: "?",
    10: "Q",
    11: "q",
    12: "d",
}


def read_gguf_index(path: Path) -> tuple[str | None, list[GGUFTensor]]:
    """(general.architecture, tensor index) from a GGUF v2/v3 header, skipping the rest of the
    metadata (a tokenizer's vocabulary included) without decoding it."""
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file")
        version, tensor_count, kv_count = struct.unpack("<IQQ", f.read(20))
        if version < 2:
            raise ValueError(f"{path}: GGUF version {version} is not supported")
        arch, alignment = None, 32
        for _ in range(kv_count):
            key = _read_str(f)
            (vtype,) = struct.unpack("<I", f.read(4))
            if key == "general.architecture" and vtype == 8:
                arch = _read_str(f)
            elif key == "general.alignment" and vtype == 4:
                (alignment,) = struct.unpack("<I", f.read(4))
            else:
                _skip_value(f, vtype)
        infos = []
        for _ in range(tensor_count):
            name = _read_str(f)
            (dims,) = struct.unpack("<I", f.read(4))
            shape = struct.unpack(f"<{dims}Q", f.read(8 * dims))
            type_id, offset = struct.unpack("<IQ", f.read(12))
            infos.append((name, shape, type_id, offset))
        start = -(-f.tell() // alignment) * alignment
    return arch, [GGUFTensor(n, tuple(s), t, start + o) for n, s, t, o in infos]


def _read_str(f: BinaryIO) -> str:
    (length,) = struct.unpack("<Q", f.read(8))
    return f.read(length).decode("utf-8", errors="replace")


def _skip_value(f: BinaryIO, vtype: int) -> None:
    if vtype in _SCALARS:
        f.seek(struct.calcsize(_SCALARS[vtype]), 1)
    elif vtype == 8:
        (length,) = struct.unpack("<Q", f.read(8))
        f.seek(length, 1)
    elif vtype == 9:
        item_type, count = struct.unpack("<IQ", f.read(12))
        if item_type in _SCALARS:
            f.seek(count * struct.calcsize(_SCALARS[item_type]), 1)
        else:
            for _ in range(count):
                _skip_value(f, item_type)
    else:
        raise ValueError(f"unknown GGUF metadata type {vtype}")


def matches_float(values: StoredValues, weight: torch.Tensor) -> bool:
    """The stored blocks dequantize to exactly the float weight the model loaded from this file."""
    return values.shape == tuple(weight.shape) and torch.equal(values.dequantize(), weight.float())
