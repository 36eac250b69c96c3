"""Mixture-of-experts feed-forward: a top-k softmax router and SwiGLU experts that run only on the
tokens routed to them (grouped by expert), plus an optional gated shared expert; weight names of the
Qwen-MoE and Mixtral checkpoint layouts. Batch-invariant: a token's output never depends on its batch.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from engine.models.layers import GatedMLP, empty_param


@dataclass(frozen=True)
class MoeSpec:
    """What a sparse block needs from config.json, whatever the family names it."""

    num_experts: int
    top_k: int
    intermediate_size: int  # per expert
    norm_topk_prob: bool  # renormalize the top-k probabilities to sum to 1
    shared_intermediate_size: int = 0  # 0: no shared expert
    shared_expert_gated: bool = False  # sigmoid(gate(x)) scales the shared expert (Qwen2-MoE)
    activation: str = "silu"  # of every expert's gated MLP


def moe_spec(cfg: Any) -> MoeSpec:
    """The sparse block of a Qwen3-MoE, Qwen2-MoE, OLMoE or Mixtral config."""
    model_type = getattr(cfg, "model_type", "")
    num_experts = _num_experts(cfg)
    inter = getattr(cfg, "moe_intermediate_size", None) or cfg.intermediate_size
    top_k = int(cfg.num_experts_per_tok)
    if num_experts and not 0 < top_k <= num_experts:  # no experts: every layer dense
        raise ValueError(
            f"num_experts_per_tok ({top_k}) must be between 1 and the number of experts "
            f"({num_experts})"
        )
    # Mixtral always renormalizes the top-k probabilities; the Qwen and OLMoE configs say.
    norm = True if model_type == "mixtral" else bool(getattr(cfg, "norm_topk_prob", False))
    shared = int(getattr(cfg, "shared_expert_intermediate_size", 0) or 0)
    act = getattr(cfg, "hidden_act", "silu")
    return MoeSpec(
        num_experts, top_k, inter, norm, shared, shared_expert_gated=shared > 0, activation=act
    )


def _num_experts(cfg: Any) -> int:  # Qwen and OLMoE say num_experts, Mixtral num_local_experts
    return int(getattr(cfg, "num_experts", None) or getattr(cfg, "num_local_experts", None) or 0)


def is_sparse_layer(cfg: Any, layer: int) -> bool:
    """Whether decoder layer `layer` has the sparse block (else a dense MLP of `intermediate_size`):
    Qwen-MoE's `decoder_sparse_step` and `mlp_only_layers`; every layer in Mixtral and OLMoE."""
    num_experts = _num_experts(cfg)
    if layer in (getattr(cfg, "mlp_only_layers", None) or []):
        return False
    step = int(getattr(cfg, "decoder_sparse_step", 1) or 1)
    return num_experts > 0 and (layer + 1) % step == 0


def rowwise_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight.T [n, out] with each row a problem of its own ([1, in] @ [in, out] in one batched
    matmul): a row's value never depends on the batch, as a plain [n, in] matmul's may. For the
    router, whose float logits pick the experts."""
    n, k = x.shape
    return torch.bmm(x.unsqueeze(1), weight.t().expand(n, k, weight.shape[0])).squeeze(1)


def rowwise_dot(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight.T for a one-row weight [1, in] -> [n, 1], the same for a row whatever the batch:
    float32 products are exact in float64 and their float64 sum rounds to the same float32 in any
    summation order (but for values within 1e-13 of a rounding boundary). A batched matmul with one
    output column is not row-invariant on every CPU (AVX2 machines showed last-bit differences)."""
    return (x.double() * weight.double()).sum(dim=-1, keepdim=True).to(x.dtype)


def shared_gate(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """sigmoid(x @ weight.T) [n, 1] for Qwen2-MoE's shared expert, the same for a row whatever the
    batch. torch's float32 sigmoid is not: its SIMD loop and its scalar remainder loop round
    differently, and which rows fall in the remainder depends on the batch size. In float64 the two
    differ by an ulp or so of float64, which rounding to float32 hides."""
    return torch.sigmoid(rowwise_dot(x, weight).double()).to(x.dtype)


def _expert(
    spec: MoeSpec, hidden: int, inter: int, dtype: torch.dtype, device: torch.device
) -> GatedMLP:
    """One expert: the dense layers' gated MLP (gate and up fused into one matmul), no biases."""
    return GatedMLP(hidden, inter, spec.activation, False, dtype, device)


class SparseMoeBlock(nn.Module):
    """Routes each token to its top-k experts and sums their outputs weighted by the router."""

    def __init__(self, spec: MoeSpec, hidden: int, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.spec = spec
        self.hidden_size = hidden
        # The router stays float under quantization (as llama.cpp keeps ffn_gate_inp): its logits
        # choose the experts, and a small error there swaps whole experts.
        self.router_weight = empty_param(spec.num_experts, hidden, dtype=dtype, device=device)
        self.experts = nn.ModuleList(
            _expert(spec, hidden, spec.intermediate_size, dtype, device)
            for _ in range(spec.num_experts)
        )
        self.shared_expert: GatedMLP | None = None
        self.shared_gate_weight: nn.Parameter | None = None
        if spec.shared_intermediate_size:
            inter = spec.shared_intermediate_size
            self.shared_expert = _expert(spec, hidden, inter, dtype, device)
            if spec.shared_expert_gated:
                self.shared_gate_weight = empty_param(1, hidden, dtype=dtype, device=device)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [n, k] in x's dtype, expert ids [n, k] int64), best expert first."""
        logits = rowwise_linear(x, self.router_weight)  # [n, num_experts]
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, self.spec.top_k, dim=-1)  # [n, k]
        if self.spec.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [n, hidden] -> [n, hidden]
        weights, ids = self.route(x)
        out = self.combine(self.run_experts(x, ids), weights)
        if self.shared_expert is not None:
            shared = self.shared_expert(x)
            if self.shared_gate_weight is not None:
                shared = shared_gate(x, self.shared_gate_weight) * shared
            out = out + shared
        return out

    def run_experts(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Each (token, slot) pair's expert output [n, k, hidden]: the pairs sorted by expert, so
        every expert runs once, on exactly the tokens routed to it."""
        n, k = ids.shape
        flat = ids.flatten()  # [n * k]
        order = torch.argsort(flat, stable=True)  # pairs grouped by expert
        counts = torch.bincount(flat, minlength=self.spec.num_experts).tolist()
        grouped = x[order // k]  # [n * k, hidden], the tokens in expert order
        out_grouped = torch.empty_like(grouped)
        start = 0
        for expert, count in zip(self.experts, counts, strict=True):
            if count:
                end = start + count
                out_grouped[start:end] = expert(grouped[start:end])
                start = end
        pairs = torch.empty_like(out_grouped)
        pairs[order] = out_grouped
        return pairs.view(n, k, self.hidden_size)

    @staticmethod
    def combine(pairs: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """sum_j weights[:, j] * pairs[:, j], added slot by slot: the same order for a token
        whatever else is in the batch."""
        out = pairs[:, 0] * weights[:, :1]  # [n, hidden]
        for j in range(1, pairs.shape[1]):
            out = out + pairs[:, j] * weights[:, j : j + 1]
        return out

    def quantizable_weights(self) -> list[tuple[Any, str]]:
        """(module, attribute) of every expert matrix (the router and shared gate stay float)."""
        experts = list(self.experts)
        if self.shared_expert is not None:
            experts.append(self.shared_expert)
        return [(e, attr) for e in experts for attr in ("gate_up_weight", "down_weight")]


# ---------------------------------------------------------------- checkpoint names


def moe_tensor_names(spec: MoeSpec) -> dict[str, tuple[str, int]]:
    """A sparse layer's checkpoint tensors (names after `layers.N.`) -> (our parameter in that
    layer, first row inside it): Qwen-MoE / OLMoE `mlp.experts.{e}.gate_proj`, Mixtral
    `block_sparse_moe.experts.{e}.w1` (gate), `w3` (up), `w2` (down); gate and up fill one matmul."""
    inter = spec.intermediate_size
    names: dict[str, tuple[str, int]] = {}
    for prefix in ("mlp", "block_sparse_moe"):
        names[f"{prefix}.gate.weight"] = ("mlp.router_weight", 0)
        for e in range(spec.num_experts):
            ours, theirs = f"mlp.experts.{e}", f"{prefix}.experts.{e}"
            for gate, up, down in (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2")):
                names[f"{theirs}.{gate}.weight"] = (f"{ours}.gate_up_weight", 0)
                names[f"{theirs}.{up}.weight"] = (f"{ours}.gate_up_weight", inter)
                names[f"{theirs}.{down}.weight"] = (f"{ours}.down_weight", 0)
    if spec.shared_intermediate_size:
        shared = spec.shared_intermediate_size
        names["mlp.shared_expert.gate_proj.weight"] = ("mlp.shared_expert.gate_up_weight", 0)
        names["mlp.shared_expert.up_proj.weight"] = ("mlp.shared_expert.gate_up_weight", shared)
        names["mlp.shared_expert.down_proj.weight"] = ("mlp.shared_expert.down_weight", 0)
        names["mlp.shared_expert_gate.weight"] = ("mlp.shared_gate_weight", 0)
    return names


# transformers' in-memory layout, which some checkpoints store: all experts in one 3-D tensor,
# gate_up_proj [E, 2 * inter, hidden] (gate rows first) and down_proj [E, hidden, inter].
_FUSED_EXPERTS = re.compile(r"(.*\.(?:mlp|block_sparse_moe)\.experts)\.(gate_up_proj|down_proj)")


def split_fused_experts(
    weights: Iterable[tuple[str, torch.Tensor]],
) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors with 3-D expert tensors split into per-expert ones, named as
    save_pretrained writes them (`...experts.{e}.gate_proj.weight`); others pass through."""
    for name, tensor in weights:
        match = _FUSED_EXPERTS.fullmatch(name)
        if match is None or tensor.dim() != 3:
            yield name, tensor
            continue
        experts, kind = match.groups()
        for e in range(tensor.shape[0]):
            if kind == "down_proj":
                yield f"{experts}.{e}.down_proj.weight", tensor[e]
            else:
                gate, up = tensor[e].chunk(2, dim=0)
                yield f"{experts}.{e}.gate_proj.weight", gate
                yield f"{experts}.{e}.up_proj.weight", up
