"""Pooling of packed batches, normalization, Matryoshka truncation and pooling config parsing."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from engine.embeddings.pooling import (
    PoolingConfig,
    normalize,
    pool,
    read_pooling_config,
    resolve_pooling,
    truncate_dimensions,
)
from engine.models.bert import PackedLayout, packed_attention

# Three sequences of lengths 2, 3 and 1, packed back to back: token i has state [i, 10 * i].
HIDDEN = torch.tensor([[float(i), 10.0 * i] for i in range(6)])  # [6, 2]
CU_SEQLENS = torch.tensor([0, 2, 5, 6])


def test_mean_pooling_averages_each_sequence_alone() -> None:
    pooled = pool(HIDDEN, CU_SEQLENS, "mean")
    assert torch.allclose(pooled, torch.tensor([[0.5, 5.0], [3.0, 30.0], [5.0, 50.0]]))


def test_cls_and_last_pooling_pick_first_and_last_token_of_each_sequence() -> None:
    assert pool(HIDDEN, CU_SEQLENS, "cls").tolist() == [[0, 0], [2, 20], [5, 50]]
    assert pool(HIDDEN, CU_SEQLENS, "last").tolist() == [[1, 10], [4, 40], [5, 50]]


@pytest.mark.parametrize("method", ["mean", "cls", "last"])
def test_pooling_a_sequence_does_not_depend_on_its_batch_mates(method: str) -> None:
    torch.manual_seed(0)
    hidden = torch.randn(6, 8)
    packed = pool(hidden, CU_SEQLENS, method)
    alone = pool(hidden[2:5], torch.tensor([0, 3]), method)
    assert torch.equal(packed[1], alone[0])


def test_pooling_returns_float32_from_bf16_states() -> None:
    assert pool(HIDDEN.bfloat16(), CU_SEQLENS, "mean").dtype == torch.float32


def test_unknown_pooling_method_is_a_user_error() -> None:
    with pytest.raises(ValueError, match="mean, cls or last"):
        pool(HIDDEN, CU_SEQLENS, "max")


def test_normalize_gives_unit_vectors_and_keeps_zero_vectors_finite() -> None:
    vectors = normalize(torch.tensor([[3.0, 4.0], [0.0, 0.0]]))
    assert torch.allclose(vectors[0], torch.tensor([0.6, 0.8]))
    assert vectors[1].tolist() == [0.0, 0.0]


def test_truncate_dimensions_keeps_leading_dims_and_renormalizes() -> None:
    vectors = normalize(torch.tensor([[3.0, 4.0, 12.0], [1.0, 0.0, 1.0]]))
    cut = truncate_dimensions(vectors, 2)
    assert cut.shape == (2, 2)
    assert torch.allclose(cut.norm(dim=-1), torch.ones(2))
    assert torch.allclose(cut[0], torch.tensor([0.6, 0.8]))
    assert torch.allclose(cut[1], torch.tensor([1.0, 0.0]))


def test_truncate_dimensions_accepts_plain_lists() -> None:
    cut = truncate_dimensions([3.0, 4.0, 12.0], 2)
    assert isinstance(cut, list)
    assert cut == pytest.approx([0.6, 0.8])
    nested = truncate_dimensions([[0.0, 2.0, 5.0]], 1)
    assert nested == [[0.0]]  # a zero leading part stays zero, not NaN


@pytest.mark.parametrize("dimensions", [0, 4, -1, 2.0, True])
def test_truncate_dimensions_rejects_out_of_range(dimensions: object) -> None:
    with pytest.raises(ValueError, match="from 1 to 3"):
        truncate_dimensions(torch.ones(2, 3), dimensions)  # type: ignore[arg-type]


# ---------------------------------------------------------------- sentence-transformers config


def _write_st_folder(
    folder: Path, pooling: dict[str, object], modules: tuple[str, ...] = ("Normalize",)
) -> Path:
    entries = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {
            "idx": 1,
            "name": "1",
            "path": "1_Pooling",
            "type": "sentence_transformers.models.Pooling",
        },
    ]
    for i, kind in enumerate(modules, start=2):
        entries.append(
            {
                "idx": i,
                "name": str(i),
                "path": f"{i}_{kind}",
                "type": f"sentence_transformers.models.{kind}",
            }
        )
    (folder / "modules.json").write_text(json.dumps(entries))
    (folder / "1_Pooling").mkdir()
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    return folder


MEAN = {
    "word_embedding_dimension": 8,
    "pooling_mode_mean_tokens": True,
    "pooling_mode_cls_token": False,
}


def test_reads_mean_pooling_and_normalize_module(tmp_path: Path) -> None:
    assert read_pooling_config(_write_st_folder(tmp_path, MEAN)) == PoolingConfig("mean", True)


def test_no_normalize_module_means_raw_vectors(tmp_path: Path) -> None:
    folder = _write_st_folder(tmp_path, {"pooling_mode_cls_token": True}, modules=())
    assert read_pooling_config(folder) == PoolingConfig("cls", False)


def test_reads_lasttoken_in_both_config_styles(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    old_style = _write_st_folder(tmp_path / "a", {"pooling_mode_lasttoken": True})
    new_style = _write_st_folder(tmp_path / "b", {"pooling_mode": "lasttoken"})
    assert read_pooling_config(old_style) == PoolingConfig("last", True)
    assert read_pooling_config(new_style) == PoolingConfig("last", True)


@pytest.mark.parametrize(
    "pooling",
    [
        {"pooling_mode_max_tokens": True},
        {"pooling_mode_mean_tokens": True, "pooling_mode_cls_token": True},
        {"pooling_mode_mean_tokens": False},
    ],
)
def test_unsupported_pooling_modes_are_rejected_with_advice(tmp_path: Path, pooling: dict) -> None:
    with pytest.raises(ValueError, match="--pooling"):
        read_pooling_config(_write_st_folder(tmp_path, pooling))


def test_modules_that_change_the_vector_are_rejected(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="Dense"):
        read_pooling_config(_write_st_folder(tmp_path, MEAN, modules=("Dense", "Normalize")))


def test_folder_without_modules_json_declares_nothing(tmp_path: Path) -> None:
    assert read_pooling_config(tmp_path) is None


def test_resolve_defaults_mean_for_encoders_last_for_decoders(tmp_path: Path) -> None:
    assert resolve_pooling(tmp_path, "auto", is_encoder=True) == PoolingConfig("mean", True)
    assert resolve_pooling(tmp_path, "auto", is_encoder=False) == PoolingConfig("last", True)


def test_explicit_pooling_overrides_the_config_but_keeps_its_normalize(tmp_path: Path) -> None:
    folder = _write_st_folder(tmp_path, MEAN, modules=())
    assert resolve_pooling(folder, "auto", is_encoder=True) == PoolingConfig("mean", False)
    assert resolve_pooling(folder, "cls", is_encoder=True) == PoolingConfig("cls", False)


def test_resolve_rejects_unknown_pooling(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="auto, mean, cls or last"):
        resolve_pooling(tmp_path, "max", is_encoder=True)


# ---------------------------------------------------------------- packed attention


def _reference_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: list[int], causal: bool
) -> torch.Tensor:
    outs, start = [], 0
    group = q.shape[1] // k.shape[1]
    for n in lengths:
        qs, ks, vs = (x[start : start + n].transpose(0, 1) for x in (q, k, v))
        ks, vs = ks.repeat_interleave(group, 0), vs.repeat_interleave(group, 0)
        scores = qs @ ks.transpose(1, 2) / math.sqrt(q.shape[-1])  # [heads, n, n]
        if causal:
            scores = scores.masked_fill(torch.ones(n, n).triu(1).bool(), float("-inf"))
        outs.append((F.softmax(scores, -1) @ vs).transpose(0, 1))
        start += n
    return torch.cat(outs)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("num_kv_heads", [4, 2])
def test_packed_attention_keeps_sequences_apart(causal: bool, num_kv_heads: int) -> None:
    torch.manual_seed(0)
    lengths = [3, 7, 1, 5]
    total = sum(lengths)
    q = torch.randn(total, 4, 8)
    k, v = torch.randn(total, num_kv_heads, 8), torch.randn(total, num_kv_heads, 8)
    cu = torch.tensor([0, 3, 10, 11, 16])
    out = packed_attention(q, k, v, PackedLayout.build(cu, causal=causal))
    expected = _reference_attention(q, k, v, lengths, causal)
    assert out.shape == q.shape
    assert torch.allclose(out, expected, atol=1e-5)
    alone = packed_attention(
        q[3:10], k[3:10], v[3:10], PackedLayout.build(torch.tensor([0, 7]), causal=causal)
    )
    assert torch.allclose(alone, out[3:10], atol=1e-6)
