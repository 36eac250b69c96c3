"""The sparse mixture-of-experts block (engine.models.moe): the same outputs as transformers' own
Qwen3-MoE, Qwen2-MoE and Mixtral blocks, experts run only on the tokens routed to them, and a token's
output bitwise the same alone and in any batch (float router, Q8_0 block experts)."""

from __future__ import annotations

import pytest
import torch

from engine.kernels import cpu_kernels
from engine.models.layers import GatedMLP
from engine.models.moe import (
    SparseMoeBlock,
    is_sparse_layer,
    moe_spec,
    moe_tensor_names,
    rowwise_linear,
    split_fused_experts,
)
from engine.models.quantization import quantize_model

needs_kernels = pytest.mark.skipif(
    not cpu_kernels.available(), reason="kvserve's C++ CPU kernels could not be built here"
)
HIDDEN, EXPERTS, TOP_K, INTER = 64, 8, 2, 32


def _qwen3_config(norm_topk_prob: bool):
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        hidden_size=HIDDEN,
        moe_intermediate_size=INTER,
        num_experts=EXPERTS,
        num_experts_per_tok=TOP_K,
        norm_topk_prob=norm_topk_prob,
        num_hidden_layers=4,
        decoder_sparse_step=2,
        mlp_only_layers=[3],
    )


def _hf_block(family: str, norm_topk_prob: bool = True) -> tuple[torch.nn.Module, object]:
    torch.manual_seed(0)
    if family == "qwen3_moe":
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

        cfg = _qwen3_config(norm_topk_prob)
        block = Qwen3MoeSparseMoeBlock(cfg)
    elif family == "qwen2_moe":
        from transformers import Qwen2MoeConfig
        from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock

        cfg = Qwen2MoeConfig(
            hidden_size=HIDDEN,
            moe_intermediate_size=INTER,
            num_experts=EXPERTS,
            num_experts_per_tok=TOP_K,
            shared_expert_intermediate_size=96,
            norm_topk_prob=norm_topk_prob,
        )
        block = Qwen2MoeSparseMoeBlock(cfg)
    else:
        from transformers import MixtralConfig
        from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

        cfg = MixtralConfig(
            hidden_size=HIDDEN,
            intermediate_size=INTER,
            num_local_experts=EXPERTS,
            num_experts_per_tok=TOP_K,
        )
        block = MixtralSparseMoeBlock(cfg)
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return block.eval(), cfg


def _load(block: SparseMoeBlock, state: dict[str, torch.Tensor]) -> None:
    """Fill our block from checkpoint tensors named inside layer 0 (`mlp.gate.weight`, ...)."""
    params = dict(block.named_parameters())
    names = moe_tensor_names(block.spec)
    filled: dict[str, int] = {}
    tensors = ((f"model.layers.0.{n}", t) for n, t in state.items())
    for name, tensor in split_fused_experts(tensors):
        ours, row = names[name.removeprefix("model.layers.0.")]
        ours = ours.removeprefix("mlp.")
        params[ours].data[row : row + tensor.shape[0]].copy_(tensor)
        filled[ours] = filled.get(ours, 0) + tensor.shape[0]
    assert filled == {n: p.shape[0] for n, p in params.items()}  # every row, once


def _ours(hf_block: torch.nn.Module, cfg: object) -> SparseMoeBlock:
    """Our block with the HF block's weights (transformers keeps experts as 3-D tensors)."""
    block = SparseMoeBlock(moe_spec(cfg), HIDDEN, torch.float32, torch.device("cpu"))
    _load(block, {f"mlp.{n}": t for n, t in hf_block.state_dict().items()})
    return block


@pytest.mark.parametrize(
    ("family", "norm"),
    [("qwen3_moe", True), ("qwen3_moe", False), ("qwen2_moe", False), ("mixtral", True)],
)
def test_the_block_equals_transformers(family: str, norm: bool) -> None:
    hf_block, cfg = _hf_block(family, norm)
    block = _ours(hf_block, cfg)
    assert block.spec.norm_topk_prob == norm
    x = torch.randn(1, 40, HIDDEN)
    with torch.inference_mode():
        expected = hf_block(x)
        expected = expected[0] if isinstance(expected, tuple) else expected
        got = block(x[0])
    torch.testing.assert_close(got, expected[0], rtol=1e-5, atol=1e-5)


def test_per_expert_checkpoint_names_load_like_the_fused_ones() -> None:
    """save_pretrained writes `experts.{e}.gate_proj` etc. (Mixtral: w1/w3/w2); in memory
    transformers keeps one 3-D `gate_up_proj`: each fills the same weights."""
    hf_block, cfg = _hf_block("qwen3_moe")
    fused = _ours(hf_block, cfg)
    gate_up = hf_block.experts.gate_up_proj.detach()  # [E, 2 * inter, hidden]
    down = hf_block.experts.down_proj.detach()  # [E, hidden, inter]
    for prefix, names in (
        ("mlp", ("gate_proj", "up_proj", "down_proj")),
        ("block_sparse_moe", ("w1", "w3", "w2")),
    ):
        state = {f"{prefix}.gate.weight": hf_block.gate.weight.detach()}
        for e in range(EXPERTS):
            gate, up = gate_up[e].chunk(2)
            for name, tensor in zip(names, (gate, up, down[e]), strict=True):
                state[f"{prefix}.experts.{e}.{name}.weight"] = tensor
        split = SparseMoeBlock(fused.spec, HIDDEN, torch.float32, torch.device("cpu"))
        _load(split, state)
        for (name, a), (_, b) in zip(
            fused.named_parameters(), split.named_parameters(), strict=True
        ):
            assert torch.equal(a, b), (prefix, name)


def test_experts_run_only_on_the_tokens_routed_to_them(monkeypatch: pytest.MonkeyPatch) -> None:
    hf_block, cfg = _hf_block("qwen3_moe")
    block = _ours(hf_block, cfg)
    x = torch.randn(12, HIDDEN)
    _, ids = block.route(x)
    seen: dict[int, int] = {}
    index = {id(e): i for i, e in enumerate(block.experts)}
    original = GatedMLP.forward

    def counting(self: GatedMLP, rows: torch.Tensor) -> torch.Tensor:
        seen[index[id(self)]] = seen.get(index[id(self)], 0) + rows.shape[0]
        return original(self, rows)

    monkeypatch.setattr(GatedMLP, "forward", counting)
    block(x)
    expected = {
        e: c for e, c in enumerate(torch.bincount(ids.flatten(), minlength=EXPERTS).tolist()) if c
    }
    assert seen == expected  # each routed expert once, with exactly its tokens; no others
    assert sum(seen.values()) == 12 * TOP_K


def test_the_router_rows_do_not_depend_on_the_batch() -> None:
    torch.manual_seed(3)
    weight = torch.randn(EXPERTS, 256)
    x = torch.randn(70, 256)
    alone = torch.cat([rowwise_linear(x[i : i + 1], weight) for i in range(70)])
    for size in (2, 5, 16, 33, 70):
        assert torch.equal(rowwise_linear(x[:size], weight), alone[:size])
    torch.testing.assert_close(alone, x @ weight.t())


class _Holder(torch.nn.Module):
    """A model-shaped owner of one block, for quantize_model."""

    def __init__(self, block: SparseMoeBlock) -> None:
        super().__init__()
        self.block = block

    def quantizable_weights(self) -> list[tuple[object, str]]:
        return self.block.quantizable_weights()


@needs_kernels
@pytest.mark.parametrize("quantization", [None, "int8"])
def test_a_token_is_bitwise_the_same_alone_and_in_any_batch(quantization: str | None) -> None:
    hf_block, cfg = _hf_block("qwen2_moe")  # routed and shared experts
    block = _ours(hf_block, cfg)
    quantize_model(_Holder(block), quantization)
    if quantization:
        assert all(
            type(getattr(e, a)).__name__ == "BlockQ8Weight" for e, a in block.quantizable_weights()
        )
    x = torch.randn(40, HIDDEN)
    with torch.inference_mode():
        alone = torch.cat([block(x[i : i + 1]) for i in range(40)])
        generator = torch.Generator().manual_seed(1)
        for size in (2, 3, 8, 17, 40):
            pick = torch.randperm(40, generator=generator)[:size]
            got = block(x[pick])
            if quantization:
                assert torch.equal(got, alone[pick]), size
            else:  # float expert matmuls over differently sized groups: close, as dense layers
                torch.testing.assert_close(got, alone[pick], rtol=1e-5, atol=1e-5)


def test_sparse_layers_follow_decoder_sparse_step_and_mlp_only_layers() -> None:
    cfg = _qwen3_config(True)
    assert [is_sparse_layer(cfg, i) for i in range(4)] == [False, True, False, False]
    _, mixtral = _hf_block("mixtral")
    assert all(is_sparse_layer(mixtral, i) for i in range(4))


def test_a_bad_top_k_is_a_clear_error() -> None:
    cfg = _qwen3_config(True)
    cfg.num_experts_per_tok = EXPERTS + 1
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        moe_spec(cfg)
    cfg.num_experts = 0  # a Qwen-MoE config without experts is dense throughout, as in transformers
    assert moe_spec(cfg).num_experts == 0 and not is_sparse_layer(cfg, 1)
