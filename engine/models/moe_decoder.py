"""The shared decoder with a sparse mixture-of-experts block (engine.models.moe) in place of the MLP
in every layer the config makes sparse; the MoE families (Qwen3-MoE, Qwen2-MoE, Mixtral) each give
it their attention's DecoderSpec."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, cast

import torch

from engine.models import decoder_cpu
from engine.models.decoder import DecoderForCausalLM
from engine.models.decoder_layer import DecoderLayer, DecoderSpec, post_attention, pre_attention
from engine.models.moe import (
    SparseMoeBlock,
    is_sparse_layer,
    moe_spec,
    moe_tensor_names,
    split_fused_experts,
)


class MoeDecoderForCausalLM(DecoderForCausalLM):
    # The expert grouping reads each step's routing on the host (one sync per sparse layer), which
    # a captured CUDA graph cannot replay: decode steps run eagerly.
    supports_cuda_graphs = False

    def __init__(self, hf_config: Any, spec: DecoderSpec, dtype: torch.dtype, device: torch.device):
        self.moe = moe_spec(hf_config)  # read by layer_tensor_names during the decoder's set-up
        super().__init__(hf_config, spec, dtype, device)
        self.sparse_layers = [i for i in range(spec.num_layers) if is_sparse_layer(hf_config, i)]
        for i in self.sparse_layers:
            layer = cast(DecoderLayer, self.layers[i])
            layer.mlp = SparseMoeBlock(self.moe, spec.hidden_size, dtype, device)  # type: ignore[assignment]
        if device.type == "cuda" and self.sparse_layers:
            # The dense MLPs just replaced were never filled; hand their memory back to the driver
            # so that the KV cache sized from free memory can use it.
            torch.cuda.empty_cache()

    def layer_tensor_names(self) -> dict[str, tuple[str, int]]:
        return super().layer_tensor_names() | moe_tensor_names(self.moe)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(split_fused_experts(weights))

    def _decode_calls(self) -> list[decoder_cpu.DecodeLayerArgs | None]:
        """As the decoder's, with no one-call C++ layer for sparse layers (it runs a dense MLP)."""
        if self._decode_args is None:
            self._decode_args = [
                None
                if isinstance(layer.mlp, SparseMoeBlock)
                else decoder_cpu.decode_layer_args(cast(DecoderLayer, layer))
                for layer in self.layers
            ]
        return self._decode_args

    def quantizable_weights(self) -> list[tuple[Any, str]]:
        """The decoder's matmul weights with every expert's in place of a sparse layer's MLP (the
        routers stay float)."""
        found = [
            (owner, attr)
            for owner, attr in super().quantizable_weights()
            if not isinstance(owner, SparseMoeBlock)
        ]
        for layer in self.layers:
            if isinstance(layer.mlp, SparseMoeBlock):
                found += layer.mlp.quantizable_weights()
        return found

    def compile_dense(self) -> None:
        """torch.compile the attention half of each layer; the MLP half stays eager (its expert
        loop depends on each step's routing)."""
        self.dense = (torch.compile(pre_attention, dynamic=True, fullgraph=True), post_attention)
