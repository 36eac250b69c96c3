"""Plain-torch BERT-family encoder (BERT, RoBERTa, XLM-RoBERTa) over packed variable-length batches,
with bidirectional attention and no KV cache."""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from engine.kernels.attention import attention_backend

logger = logging.getLogger(__name__)

_ACTIVATIONS = {
    "gelu": F.gelu,
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}
# RoBERTa-style models number positions from padding_idx + 1.
_OFFSET_POSITION_MODELS = ("roberta", "xlm-roberta", "camembert")


@dataclass
class PackedLayout:
    """Where each packed token sits in a padded [batch, max_len] grid, built once per forward so
    every layer reuses the same indices and mask (and, on CUDA, syncs for `max_len` only once)."""

    cu_seqlens: torch.Tensor  # [batch + 1] offsets of each sequence in the packed tokens
    max_len: int
    causal: bool
    seq_index: torch.Tensor | None = None  # [num_tokens] sequence of each token (batch > 1 only)
    pos_index: torch.Tensor | None = None  # [num_tokens] position within its sequence
    mask: torch.Tensor | None = (
        None  # [batch, 1, 1 or max_len, max_len] True where attention is allowed
    )

    @classmethod
    def build(cls, cu_seqlens: torch.Tensor, causal: bool) -> PackedLayout:
        lengths = cu_seqlens[1:] - cu_seqlens[:-1]  # [batch]
        batch, max_len = lengths.numel(), int(lengths.max())
        if batch == 1:
            return cls(cu_seqlens, max_len, causal)
        device = cu_seqlens.device
        num_tokens = int(cu_seqlens[-1])
        seq_index = torch.repeat_interleave(
            torch.arange(batch, device=device), lengths, output_size=num_tokens
        )
        pos_index = torch.arange(num_tokens, device=device) - cu_seqlens[:-1][seq_index]
        positions = torch.arange(max_len, device=device)
        mask = positions[None, None, None, :] < lengths[:, None, None, None]
        if causal:
            mask = mask & (positions[None, :] <= positions[:, None])
        return cls(cu_seqlens, max_len, causal, seq_index, pos_index, mask)


def packed_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: PackedLayout
) -> torch.Tensor:
    """Attention of each sequence over its own tokens only, in one SDPA call.

    q: [num_tokens, num_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim].
    Returns [num_tokens, num_heads, head_dim]. Linear layers run on the packed tokens; only
    attention pads to the longest sequence, with padded keys masked out, so no sequence sees
    another's tokens or padding. On CUDA with flash-attn installed (half precision), one varlen
    flash-attn call needs no padding at all.
    """
    gqa = k.shape[1] != q.shape[1]
    half = q.dtype in (torch.float16, torch.bfloat16)
    if half and attention_backend(q.device.type, q.dtype) == "flash":
        from flash_attn import flash_attn_varlen_func

        cu, n = layout.cu_seqlens.to(torch.int32), layout.max_len
        return flash_attn_varlen_func(q, k, v, cu, cu, n, n, causal=layout.causal)
    if layout.seq_index is None:  # a single sequence: no padding, no mask
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1),
            k.transpose(0, 1),
            v.transpose(0, 1),
            is_causal=layout.causal,
            enable_gqa=gqa,
        )
        return out.transpose(0, 1)  # [num_tokens, num_heads, head_dim]
    seq_index, pos_index = layout.seq_index, layout.pos_index
    batch = layout.cu_seqlens.numel() - 1

    def to_padded(x: torch.Tensor) -> torch.Tensor:
        padded = x.new_zeros(batch, layout.max_len, x.shape[1], x.shape[2])
        padded[seq_index, pos_index] = x
        return padded.transpose(1, 2)  # [batch, heads, max_len, head_dim]

    out = F.scaled_dot_product_attention(
        to_padded(q), to_padded(k), to_padded(v), attn_mask=layout.mask, enable_gqa=gqa
    )  # [batch, num_heads, max_len, head_dim]
    return out.transpose(1, 2)[seq_index, pos_index]


class BertEmbeddings(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.word = nn.Embedding(config.vocab_size, hidden)
        self.position = nn.Embedding(config.max_position_embeddings, hidden)
        self.token_type = nn.Embedding(config.type_vocab_size, hidden)
        self.norm = nn.LayerNorm(hidden, eps=config.layer_norm_eps)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, token_type_ids: torch.Tensor
    ) -> torch.Tensor:
        x = self.word(input_ids) + self.position(positions) + self.token_type(token_type_ids)
        return self.norm(x)  # [num_tokens, hidden]


class BertLayer(nn.Module):
    """Post-LayerNorm transformer block: attention and MLP each followed by residual + LayerNorm."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_dim = hidden // self.num_heads
        self.qkv = nn.Linear(hidden, 3 * hidden)  # query, key, value fused
        self.attn_out = nn.Linear(hidden, hidden)
        self.attn_norm = nn.LayerNorm(hidden, eps=config.layer_norm_eps)
        self.up = nn.Linear(hidden, config.intermediate_size)
        self.down = nn.Linear(config.intermediate_size, hidden)
        self.mlp_norm = nn.LayerNorm(hidden, eps=config.layer_norm_eps)
        self.act = _ACTIVATIONS[config.hidden_act]

    def forward(self, x: torch.Tensor, layout: PackedLayout) -> torch.Tensor:
        num_tokens = x.shape[0]
        qkv = self.qkv(x).view(num_tokens, 3, self.num_heads, self.head_dim)
        attn = packed_attention(qkv[:, 0], qkv[:, 1], qkv[:, 2], layout)
        x = self.attn_norm(x + self.attn_out(attn.reshape(num_tokens, -1)))
        return self.mlp_norm(x + self.down(self.act(self.up(x))))  # [num_tokens, hidden]


class BertModel(nn.Module):
    """Encoder stack returning the last hidden state of every packed token."""

    def __init__(self, hf_config: Any, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        _check_config(hf_config)
        self.config = hf_config
        self.position_offset = (
            hf_config.pad_token_id + 1 if hf_config.model_type in _OFFSET_POSITION_MODELS else 0
        )
        with torch.device("meta"):  # weights are allocated for real only once, by load_weights
            self.embeddings = BertEmbeddings(hf_config)
            self.layers = nn.ModuleList(
                BertLayer(hf_config) for _ in range(hf_config.num_hidden_layers)
            )
        self.to_empty(device=device)
        self.to(dtype)

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens], 0-based within each sequence
        cu_seqlens: torch.Tensor,  # [batch + 1]
        token_type_ids: torch.Tensor | None = None,  # [num_tokens]; None -> all segment 0
    ) -> torch.Tensor:
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(input_ids)
        x = self.embeddings(input_ids, positions + self.position_offset, token_type_ids)
        layout = PackedLayout.build(cu_seqlens, causal=False)
        for layer in self.layers:
            x = layer(x, layout)
        return x  # [num_tokens, hidden]

    @property
    def max_positions(self) -> int:
        return self.config.max_position_embeddings - self.position_offset

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF checkpoint tensors (names with or without a `bert.`/`roberta.` prefix) in place."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for hf_name, tensor in weights:
            target = _map_name(hf_name)
            if target is None:
                continue
            name, part = target
            if name not in params:
                raise ValueError(f"checkpoint tensor {hf_name} has no place in the BERT model")
            param = params[name]
            dest = param.data if part is None else param.data.chunk(3, dim=0)[part]
            if dest.shape != tensor.shape:
                raise ValueError(
                    f"checkpoint tensor {hf_name} has shape {tuple(tensor.shape)}, "
                    f"expected {tuple(dest.shape)}; is config.json from the same model?"
                )
            dest.copy_(tensor)
            loaded.add(name if part is None else f"{name}#{part}")
        expected = {n for n in params if ".qkv." not in n}
        expected |= {f"{n}#{i}" for n in params if ".qkv." in n for i in range(3)}
        missing = sorted(expected - loaded)
        if missing:
            raise ValueError(
                f"the checkpoint lacks {len(missing)} BERT tensors, e.g. {missing[:3]}"
            )


def _check_config(config: Any) -> None:
    kind = getattr(config, "position_embedding_type", "absolute")
    if kind != "absolute":
        raise ValueError(f"BERT position_embedding_type {kind!r} is not supported (only absolute)")
    if config.hidden_act not in _ACTIVATIONS:
        raise ValueError(f"BERT hidden_act {config.hidden_act!r} is not supported")
    if config.hidden_size % config.num_attention_heads:
        raise ValueError("BERT hidden_size must be a multiple of num_attention_heads")


_PREFIXES = ("bert.", "roberta.", "model.")
_SKIPPED = ("pooler.", "cls.", "lm_head.", "embeddings.position_ids", "embeddings.token_type_ids")
_EMBEDDING_NAMES = {
    "embeddings.word_embeddings": "embeddings.word",
    "embeddings.position_embeddings": "embeddings.position",
    "embeddings.token_type_embeddings": "embeddings.token_type",
    "embeddings.LayerNorm": "embeddings.norm",
}
_LAYER_NAMES = {
    "attention.self.query": ("qkv", 0),
    "attention.self.key": ("qkv", 1),
    "attention.self.value": ("qkv", 2),
    "attention.output.dense": ("attn_out", None),
    "attention.output.LayerNorm": ("attn_norm", None),
    "intermediate.dense": ("up", None),
    "output.dense": ("down", None),
    "output.LayerNorm": ("mlp_norm", None),
}
_LAYER_RE = re.compile(r"encoder\.layer\.(\d+)\.(.+)\.(weight|bias|gamma|beta)$")


def _map_name(hf_name: str) -> tuple[str, int | None] | None:
    """HF tensor name -> (our parameter name, q/k/v slice or None); None for unused tensors."""
    for prefix in _PREFIXES:
        if hf_name.startswith(prefix):
            hf_name = hf_name[len(prefix) :]
            break
    if hf_name.startswith(_SKIPPED):
        return None
    # Old checkpoints name LayerNorm parameters gamma/beta.
    hf_name = re.sub(r"\.gamma$", ".weight", re.sub(r"\.beta$", ".bias", hf_name))
    module, _, kind = hf_name.rpartition(".")
    if module in _EMBEDDING_NAMES:
        return f"{_EMBEDDING_NAMES[module]}.{kind}", None
    match = _LAYER_RE.match(hf_name)
    if match and match.group(2) in _LAYER_NAMES:
        ours, part = _LAYER_NAMES[match.group(2)]
        return f"layers.{match.group(1)}.{ours}.{kind}", part
    raise ValueError(f"unexpected tensor {hf_name!r} in a BERT checkpoint")
