"""The decoder every family shares (Llama, Mistral, Qwen2, Qwen3, Phi-3, Gemma 3), in plain torch over
the paged KV cache. A family file reads its config into a `DecoderSpec` (which optional parts a
block has) and maps its checkpoint names; q/k/v and gate/up are fused into single matmuls."""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Literal, cast

import torch
from torch import nn

from engine.kernels import cpu_kernels
from engine.kernels.attention import uses_cpu_kernels
from engine.kernels.kv_dtype import kernels_read
from engine.kernels.metadata import AttentionMetadata
from engine.models import decoder_cpu
from engine.models.decoder_layer import (
    DecoderLayer,
    DecoderSpec,
    DenseFns,
    post_attention,
    pre_attention,
)
from engine.models.layers import RMSNorm, optional_param, softcap
from engine.models.lora_apply import LoRABatch, one_call_args
from engine.models.quantization import linear
from engine.models.rotary import RotaryEmbedding

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DecodePlan:
    """csrc/decode_layer.cpp's decode_layers per-model arguments (cpu_kernels.decode_plan: every
    layer's weights, kinds, floats and ints, held on the C++ side) and each layer's rotary."""

    handle: Any  # torch.classes.kvserve.DecodePlan
    rope_index: tuple[int, ...]  # per layer, the index of its rotary in DecoderForCausalLM.rotaries
    all_zero: list[int]  # per layer 0: every layer reads the step's one set of tensors


def common_spec(cfg: Any) -> dict[str, Any]:
    """The DecoderSpec fields every Llama-like config spells the same way."""
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    return dict(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_layers=cfg.num_hidden_layers,
        num_heads=heads,
        num_kv_heads=getattr(cfg, "num_key_value_heads", None) or heads,
        head_dim=head_dim,
        max_position_embeddings=cfg.max_position_embeddings,
        rms_norm_eps=cfg.rms_norm_eps,
        tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
        attention_scale=head_dim**-0.5,
        layer_windows=tuple(layer_windows_of(cfg)),
    )


def layer_windows_of(cfg: Any) -> list[int | None]:
    """Each layer's sliding window as transformers applies it: configs with `layer_types` (Qwen2/3
    build them from `use_sliding_window` and `max_window_layers`; Gemma 3 from its pattern) slide
    where a type says "sliding_attention"; Mistral and any other config with `sliding_window`
    slide everywhere. A window no shorter than max_position_embeddings never drops a key, so it
    is reported as None."""
    num_layers = cfg.num_hidden_layers
    window = getattr(cfg, "sliding_window", None)
    if not window or not getattr(cfg, "use_sliding_window", True):
        return [None] * num_layers
    if window >= cfg.max_position_embeddings:
        return [None] * num_layers
    types = getattr(cfg, "layer_types", None)
    if getattr(cfg, "model_type", "") == "mistral" or not types:
        return [int(window)] * num_layers
    return [int(window) if t == "sliding_attention" else None for t in types[:num_layers]]


class DecoderForCausalLM(nn.Module):
    """A causal LM over the shared decoder; families subclass it with their spec and names."""

    def __init__(self, hf_config: Any, spec: DecoderSpec, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.config = hf_config
        self.spec = spec
        self.dtype = dtype
        self.vocab_size = spec.vocab_size
        self.hidden_size = spec.hidden_size
        self.num_layers = spec.num_layers
        self.num_heads = spec.num_heads
        self.num_kv_heads = spec.num_kv_heads
        self.head_dim = spec.head_dim
        self.tie_word_embeddings = spec.tie_word_embeddings
        self.max_position_embeddings = spec.max_position_embeddings
        self.layer_windows: list[int | None] = list(spec.layer_windows or [None] * spec.num_layers)
        self.rotaries = nn.ModuleList(
            RotaryEmbedding(spec.head_dim, spec.max_position_embeddings, params, dtype, device)
            for params in spec.rope
        )
        embedding = torch.empty(spec.vocab_size, spec.hidden_size, dtype=dtype, device=device)
        self.embed_tokens = nn.Embedding(
            spec.vocab_size, spec.hidden_size, _weight=embedding, _freeze=True
        )
        # Gemma scales in the model dtype (sqrt(3072) = 55.4256 is 55.5 in bfloat16), as transformers.
        self.embed_scale: torch.Tensor | None = None
        if spec.embed_scale is not None:
            self.embed_scale = torch.tensor(spec.embed_scale).to(dtype=dtype, device=device)
        self.layers = nn.ModuleList(
            DecoderLayer(spec, i, dtype, device) for i in range(spec.num_layers)
        )
        self.norm = RMSNorm(
            spec.hidden_size, spec.rms_norm_eps, dtype, device, unit_offset=spec.gemma_norms
        )
        self.dense: DenseFns | None = None  # compiled dense halves of a layer (compile_dense)
        self._decode_args: list[decoder_cpu.DecodeLayerArgs | None] | None = None
        self._plan: DecodePlan | Literal[False] | None = None  # _decode_plan (False: not possible)
        self.lm_head_weight: torch.Tensor | None = optional_param(
            spec.vocab_size,
            spec.hidden_size,
            dtype=dtype,
            device=device,
            enabled=not spec.tie_word_embeddings,
        )
        self._layer_tensors = self.layer_tensor_names()

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
        lora: LoRABatch | None = None,
    ) -> torch.Tensor:
        # input_ids, positions: [num_tokens] int64 -> [num_tokens, hidden_size]
        # `lora`: the step's adapter segments (None: every row runs the base model).
        h = self.embed_tokens(input_ids)
        if self.embed_scale is not None:
            h = h * self.embed_scale
        ropes = [cast(RotaryEmbedding, r).lookup(positions) for r in self.rotaries]
        fused = self.dense is None and all(kernels_read(c.dtype, h.dtype) for c in kv_caches)
        if fused and uses_cpu_kernels(meta, h.device, h.dtype):
            return self._forward_cpu_kernels(ropes, h, kv_caches, meta, lora)
        for module, kv_cache in zip(self.layers, kv_caches, strict=True):
            layer = cast(DecoderLayer, module)
            rope = ropes[layer.self_attn.rope_index]
            layer_lora = lora.layer(layer.index) if lora is not None else None
            h = layer(rope, h, kv_cache, meta.for_layer(layer.index), self.dense, layer_lora)
        return self.norm(h)

    def _forward_cpu_kernels(
        self,
        ropes: list[tuple[torch.Tensor, torch.Tensor]],
        h: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
        lora: LoRABatch | None = None,
    ) -> torch.Tensor:
        cos_sins = [(cos.squeeze(1), sin.squeeze(1)) for cos, sin in ropes]  # [n, r // 2] each
        # The one-call layer runs every query token over its own causal context, as the fused
        # layer's attention does: pure decode steps, and steps of short queries (speculative
        # verification, small chunks) given each token's own block table and context length.
        pure_decode = meta.num_decode_seqs == meta.num_seqs
        one_call = pure_decode or meta.max_query_len <= ONE_CALL_MAX_QUERY_LEN
        calls = self._decode_calls() if one_call else None

        def context(lmeta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
            """The one-call layer's block tables and context lengths: per sequence, or per token."""
            return (lmeta.block_tables, lmeta.seq_lens) if pure_decode else lmeta.token_context()

        plan = self._decode_plan() if one_call and lora is None else None
        if plan is not None and len(plan.rope_index) == len(kv_caches):  # every layer in one call
            shared, where = self._step_tensors(plan, cos_sins, meta, context)
            h = cpu_kernels.decode_layers(h, plan.handle, kv_caches, shared, where)
            return decoder_cpu.norm(self.norm, h)
        for i, kv_cache in enumerate(kv_caches):
            layer = cast(DecoderLayer, self.layers[i])
            cos, sin = cos_sins[layer.self_attn.rope_index]
            lmeta = meta.for_layer(i)
            args = calls[i] if calls is not None else None
            if args is None:
                layer_lora = lora.layer(i) if lora is not None else None
                h = decoder_cpu.fused_layer(layer, (cos, sin), h, kv_cache, lmeta, layer_lora)
                continue
            w, kinds, eps, heads, kv_heads, scale, window, cap = args
            tables, lens = context(lmeta)
            deltas = one_call_args(lora.layer(i)) if lora is not None else None
            h = cpu_kernels.decode_layer(
                h, w, kinds, eps, cos, sin, kv_cache, lmeta.slot_mapping, tables, lens,
                heads, kv_heads, scale, window, cap, deltas,
            )  # fmt: skip
        return decoder_cpu.norm(self.norm, h)

    def _step_tensors(
        self,
        plan: DecodePlan,
        cos_sins: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
        context: Callable[[AttentionMetadata], tuple[torch.Tensor, torch.Tensor]],
    ) -> tuple[list[torch.Tensor], list[int]]:
        """decode_layers' step tensors: per distinct (rotary, KV-cache group) of the layers its cos,
        sin, slot mapping, block tables and context lengths; and per layer, which set it reads."""
        if not meta.layer_metas and len(cos_sins) == 1:  # one set for every layer
            return [*cos_sins[0], meta.slot_mapping, *context(meta)], plan.all_zero
        shared: list[torch.Tensor] = []
        where: list[int] = []
        sets: dict[tuple[int, int], int] = {}
        for i, rope in enumerate(plan.rope_index):
            lmeta = meta.for_layer(i)
            key = (rope, id(lmeta))
            if key not in sets:
                sets[key] = len(sets)
                shared += [*cos_sins[rope], lmeta.slot_mapping, *context(lmeta)]
            where.append(sets[key])
        return shared, where

    def limit_context(self, max_model_len: int) -> None:
        """The longest context the engine serves (LongRoPE picks its factors by it)."""
        for rotary in self.rotaries:
            cast(RotaryEmbedding, rotary).limit_context(max_model_len)

    def _decode_calls(self) -> list[decoder_cpu.DecodeLayerArgs | None]:
        """Per layer, the one-call decode layer's arguments (built once: weights_changed resets)."""
        if self._decode_args is None:
            self._decode_args = [
                decoder_cpu.decode_layer_args(cast(DecoderLayer, layer)) for layer in self.layers
            ]
        return self._decode_args

    def _decode_plan(self) -> DecodePlan | None:
        """decode_layers' per-model arguments (every layer's weights, counts, kinds, floats and
        ints), when every layer runs the one-call layer; None otherwise. Built once."""
        if self._plan is None:
            calls = self._decode_calls()
            if any(args is None for args in calls):
                self._plan = False
            else:
                weights: list[torch.Tensor] = []
                counts: list[int] = []
                kinds: list[int] = []
                floats: list[float] = []
                ints: list[int] = []
                for args in calls:
                    w, k, eps, heads, kv_heads, scale, window, cap = cast(
                        decoder_cpu.DecodeLayerArgs, args
                    )
                    weights += w
                    kinds += k
                    counts += [len(w), len(k)]
                    floats += [eps, scale, cap or 0.0]
                    ints += [heads, kv_heads, window or 0]
                handle = cpu_kernels.decode_plan(weights, counts, kinds, floats, ints)
                ropes = tuple(
                    cast(DecoderLayer, layer).self_attn.rope_index for layer in self.layers
                )
                self._plan = DecodePlan(handle, ropes, [0] * len(ropes))
        return self._plan or None

    def weights_changed(self) -> None:
        """Called after matmul weights were replaced (quantization): forget what was derived."""
        self._decode_args = None
        self._plan = None
        for module in self.modules():
            if isinstance(module, RMSNorm):
                module.weights_changed()

    def compile_dense(self) -> None:
        """torch.compile the per-layer dense code (norms, projections, rotary, MLP, residuals) once,
        shared by every layer, with a dynamic token count; paged attention stays eager."""
        self.dense = (
            torch.compile(pre_attention, dynamic=True, fullgraph=True),
            torch.compile(post_attention, dynamic=True, fullgraph=True),
        )

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [n, hidden] -> [n, vocab]
        weight = self.embed_tokens.weight if self.lm_head_weight is None else self.lm_head_weight
        return softcap(linear(hidden, weight), self.spec.final_softcap).float()

    def quantizable_weights(self) -> list[tuple[Any, str]]:
        """(module, attribute) of every matmul weight, for engine.models.quantization. A tied head gets
        its own reference to the embedding, so the head can be packed while lookups stay exact."""
        if self.lm_head_weight is None:
            self.lm_head_weight = self.embed_tokens.weight
        found: list[tuple[Any, str]] = [(self, "lm_head_weight")]
        for layer in self.layers:
            found += [(layer.self_attn, "qkv_weight"), (layer.self_attn, "o_weight")]
            found += [(layer.mlp, "gate_up_weight"), (layer.mlp, "down_weight")]
        return found

    # ------------------------------------------------------------ weight loading

    def layer_tensor_names(self) -> dict[str, tuple[str, int]]:
        """A layer's checkpoint tensor (name after `layers.N.`) -> (our parameter in that layer,
        first row inside it): separate q/k/v and gate/up land in the fused matmuls. Families with
        other names add theirs."""
        q, kv, inter = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim, 0
        inter = self.spec.intermediate_size
        names: dict[str, tuple[str, int]] = {}
        for kind in ("weight", "bias"):
            names |= {
                f"self_attn.q_proj.{kind}": (f"self_attn.qkv_{kind}", 0),
                f"self_attn.k_proj.{kind}": (f"self_attn.qkv_{kind}", q),
                f"self_attn.v_proj.{kind}": (f"self_attn.qkv_{kind}", q + kv),
                f"self_attn.o_proj.{kind}": (f"self_attn.o_{kind}", 0),
                f"mlp.gate_proj.{kind}": (f"mlp.gate_up_{kind}", 0),
                f"mlp.up_proj.{kind}": (f"mlp.gate_up_{kind}", inter),
                f"mlp.down_proj.{kind}": (f"mlp.down_{kind}", 0),
            }
        for norm in (
            "input_layernorm",
            "post_attention_layernorm",
            "pre_feedforward_layernorm",
            "post_feedforward_layernorm",
            "self_attn.q_norm",
            "self_attn.k_norm",
        ):
            names[f"{norm}.weight"] = (f"{norm}.weight", 0)
        return names

    def checkpoint_name(self, hf_name: str) -> str | None:
        """A checkpoint tensor's name as the decoder sees it (`layers.0...`, `embed_tokens.weight`),
        `lm_head.weight`, or None to skip it quietly (a vision tower beside the text model)."""
        return hf_name.removeprefix("model.")

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy Hugging Face tensors into our (fused) parameters; every parameter must be filled."""
        params = dict(self.named_parameters())
        filled: dict[str, int] = {}  # parameter -> rows written, to know fused ones are complete
        for hf_name, tensor in weights:
            target = self._map_name(hf_name)
            if target is None:
                continue
            name, row_offset = target
            if name not in params:
                raise ValueError(
                    f"checkpoint tensor {hf_name} does not fit this model's configuration"
                )
            param = params[name]
            rows = tensor.shape[0]
            dest = param.data[row_offset : row_offset + rows]
            if dest.shape != tensor.shape:
                raise ValueError(
                    f"checkpoint tensor {hf_name} has shape {tuple(tensor.shape)}, "
                    f"expected {tuple(dest.shape)} from config.json"
                )
            dest.copy_(tensor)
            filled[name] = filled.get(name, 0) + rows
        missing = [n for n, p in params.items() if filled.get(n, 0) != p.shape[0]]
        if missing:
            shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
            raise ValueError(
                f"checkpoint is missing weights for {len(missing)} parameters: {shown}"
            )
        self.weights_changed()

    def _map_name(self, hf_name: str) -> tuple[str, int] | None:
        """HF tensor name -> (our parameter name, first row inside it), or None to skip."""
        if hf_name.endswith("rotary_emb.inv_freq"):
            return None
        name = self.checkpoint_name(hf_name)
        if name is None:
            return None
        if name == "lm_head.weight":
            return None if self.tie_word_embeddings else ("lm_head_weight", 0)
        if name in ("embed_tokens.weight", "norm.weight"):
            return name, 0
        match = _LAYER_NAME.fullmatch(name)
        part = self._layer_tensors.get(match[2]) if match else None
        if match is None or part is None:
            logger.warning("ignoring unexpected checkpoint tensor %s", hf_name)
            return None
        ours, offset = part
        return f"layers.{match[1]}.{ours}", offset


# Steps whose longest query is at most this many tokens run the one-call C++ layer (the Python fused
# layer's dispatch costs about half a decode step at batch 1; long prefill chunks do not notice it).
ONE_CALL_MAX_QUERY_LEN = 64
_LAYER_NAME = re.compile(r"layers\.(\d+)\.(.+)")
