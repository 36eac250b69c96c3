"""Embedding models: an encoder (BERT family) or a decoder (any family kvserve generates with, causal)
run over a packed batch with no KV cache kept, then pooled (mean / cls / last token) and L2-normalized;
the folder's sentence-transformers prompts ride along for the server to apply."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn

from engine.embeddings.pooling import PoolingConfig, normalize, pool, resolve_pooling
from engine.embeddings.prompts import EmbeddingPrompts, read_prompts
from engine.models.loader import checkpoint_dtype, iter_weights, resolve_device, resolve_dtype
from engine.models.lora_apply import LoRABatch

logger = logging.getLogger(__name__)

ENCODER_MODEL_TYPES = ("bert", "roberta", "xlm-roberta", "camembert")
_SCRATCH_BLOCK_SIZE = 16


def cu_seqlens_of(lengths: list[int], device: torch.device) -> torch.Tensor:
    """[batch + 1] int64 offsets of back-to-back sequences of the given lengths."""
    offsets = [0]
    for n in lengths:
        offsets.append(offsets[-1] + n)
    return torch.tensor(offsets, dtype=torch.int64, device=device)


def positions_of(lengths: list[int], device: torch.device) -> torch.Tensor:
    """[num_tokens] position of each packed token within its own sequence."""
    return torch.cat([torch.arange(n, device=device) for n in lengths])


class EmbeddingModel:
    """Loads an embedding model (a BERT-family encoder, or a decoder of any registered family with
    last-token pooling) and turns a packed batch of token sequences into pooled, normalized vectors."""

    def __init__(
        self,
        model: nn.Module,
        hf_config: Any,
        pooling: PoolingConfig,
        max_model_len: int,
        is_encoder: bool,
        dtype: torch.dtype,
        device: torch.device,
        prompts: EmbeddingPrompts | None = None,
    ) -> None:
        self.model = model
        self.hf_config = hf_config
        self.pooling_config = pooling
        self.max_model_len = max_model_len
        self.is_encoder = is_encoder
        self.hidden_size = int(hf_config.hidden_size)
        self.dtype = dtype
        self.device = device
        self.prompts = prompts or EmbeddingPrompts()

    @property
    def pooling(self) -> str:
        return self.pooling_config.method

    @property
    def normalize(self) -> bool:
        return self.pooling_config.normalize

    @classmethod
    def load(
        cls, model_dir: Path, dtype: str = "auto", device: str = "auto", pooling: str = "auto"
    ) -> EmbeddingModel:
        """Build the encoder or decoder named by `model_dir/config.json` and load its weights.

        pooling "auto" follows the folder's sentence-transformers config (modules.json ->
        Pooling module), else mean for encoders and the last token for decoders.
        """
        from transformers import AutoConfig

        model_dir = Path(model_dir)
        if not (model_dir / "config.json").is_file():
            raise ValueError(
                f"{model_dir} has no config.json; expected a Hugging Face model folder"
            )
        try:
            hf_config = AutoConfig.from_pretrained(model_dir)
        except Exception as e:  # noqa: BLE001 - transformers raises many kinds
            raise ValueError(f"could not read {model_dir / 'config.json'}: {e}") from e
        is_encoder = is_encoder_config(hf_config)
        torch_device = resolve_device(device)
        torch_dtype = resolve_dtype(dtype, torch_device, checkpoint_dtype(hf_config))
        pooling_config = resolve_pooling(model_dir, pooling, is_encoder)
        prompts = read_prompts(model_dir)
        _check_prompt_pooling(model_dir, pooling_config, prompts)
        start = time.perf_counter()
        if is_encoder:
            from engine.models.bert import BertModel

            encoder = BertModel(hf_config, dtype=torch_dtype, device=torch_device)
            encoder.load_weights(iter_weights(model_dir))
            max_positions = encoder.max_positions
            model: nn.Module = encoder
        else:
            model = _load_decoder(hf_config, model_dir, torch_dtype, torch_device)
            max_positions = int(getattr(hf_config, "max_position_embeddings", 2048))
        max_len = min(max_positions, _sentence_transformers_max_len(model_dir))
        model.eval()
        logger.info(
            "loaded embedding model %s (%s, %s, %s pooling%s, max %d tokens) in %.2fs",
            model_dir,
            "encoder" if is_encoder else "decoder",
            torch_dtype,
            pooling_config.method,
            ", normalized" if pooling_config.normalize else "",
            max_len,
            time.perf_counter() - start,
        )
        return cls(
            model,
            hf_config,
            pooling_config,
            max_len,
            is_encoder,
            torch_dtype,
            torch_device,
            prompts,
        )

    # ------------------------------------------------------------------ running

    @torch.inference_mode()
    def embed(self, token_ids: list[list[int]], lora: LoRABatch | None = None) -> torch.Tensor:
        """[batch, hidden] float32 vectors on the CPU, one per sequence, in input order; `lora`:
        the batch's LoRA adapter segments (a decoder's), over the packed tokens."""
        if not token_ids:
            return torch.empty(0, self.hidden_size)
        lengths = [len(ids) for ids in token_ids]
        for i, n in enumerate(lengths):
            if n == 0:
                raise ValueError(f"input {i} is empty; an embedding needs at least one token")
            if n > self.max_model_len:
                raise ValueError(
                    f"input {i} has {n} tokens but the model accepts at most {self.max_model_len}; "
                    "shorten it or ask for truncation"
                )
        flat = [t for ids in token_ids for t in ids]
        input_ids = torch.tensor(flat, dtype=torch.int64, device=self.device)  # [num_tokens]
        vectors = self.embed_packed(
            input_ids, positions_of(lengths, self.device), cu_seqlens_of(lengths, self.device), lora
        )
        return vectors.cpu()

    @torch.inference_mode()
    def embed_packed(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        cu_seqlens: torch.Tensor,
        lora: LoRABatch | None = None,
    ) -> torch.Tensor:
        """Vectors for back-to-back sequences on the model's device.

        input_ids, positions: [num_tokens]; cu_seqlens: [batch + 1]. Returns [batch, hidden] float32.
        """
        if self.is_encoder:
            hidden = self.model(input_ids, positions, cu_seqlens)  # [num_tokens, hidden]
        else:
            hidden = _decoder_forward(self.model, input_ids, positions, cu_seqlens, lora)
        vectors = pool(hidden, cu_seqlens, self.pooling)  # [batch, hidden] float32
        return normalize(vectors) if self.normalize else vectors


def is_encoder_config(hf_config: Any) -> bool:
    """True for BERT-family encoders, False for decoders of a registered family; ValueError
    otherwise."""
    model_type = getattr(hf_config, "model_type", None)
    if model_type in ENCODER_MODEL_TYPES:
        return True
    if decoder_class(hf_config) is not None:
        return False
    from engine.models import supported_architectures

    supported = ", ".join([*ENCODER_MODEL_TYPES, *supported_architectures()])
    raise ValueError(
        f"model type {model_type!r} cannot be served as an embedding model; supported: {supported}"
    )


def decoder_class(hf_config: Any) -> Callable[..., nn.Module] | None:
    """The kvserve decoder for a config, by its architectures or its model type: embedding
    checkpoints are often headless (`Qwen3Model` for `Qwen3ForCausalLM`)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from engine.models import MODEL_REGISTRY

    names = list(getattr(hf_config, "architectures", None) or [])
    names.append(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(getattr(hf_config, "model_type", ""), ""))
    for name in names:
        for candidate in (name, name.removesuffix("Model") + "ForCausalLM"):
            if candidate in MODEL_REGISTRY:
                return cast(Callable[..., nn.Module], MODEL_REGISTRY[candidate])
    return None


def _check_prompt_pooling(
    model_dir: Path, pooling: PoolingConfig, prompts: EmbeddingPrompts
) -> None:
    """Leaving a prompt's tokens out of a mean or first-token pool is not done here: refuse at start
    rather than return vectors that differ from sentence-transformers' (the last token is the
    input's own, so last-token pooling is unaffected)."""
    if pooling.include_prompt or pooling.method == "last" or not any(prompts.prompts.values()):
        return
    raise ValueError(
        f"{model_dir}: its Pooling module leaves prompt tokens out of {pooling.method} pooling "
        "(include_prompt: false), which kvserve does not do; pass --pooling last, or serve a "
        "folder without prompts"
    )


def _sentence_transformers_max_len(model_dir: Path) -> int:
    """max_seq_length from sentence_bert_config.json, or a large number when absent."""
    config_file = model_dir / "sentence_bert_config.json"
    if not config_file.is_file():
        return 1 << 30
    try:
        value = json.loads(config_file.read_text()).get("max_seq_length")
    except (OSError, json.JSONDecodeError, AttributeError) as e:
        raise ValueError(f"could not read {config_file}: {e}") from e
    return int(value) if value else 1 << 30


# ------------------------------------------------------------------ decoder adapter
# The decoder path reuses engine.models.llama unchanged: its forward takes a paged KV cache and
# attention metadata, so a no-KV full causal pass hands it a scratch cache holding just this
# batch's tokens. Every layer writes and then reads its own K/V before the next layer starts, so
# all layers can share one scratch tensor; nothing outlives the call.


def _load_decoder(
    hf_config: Any, model_dir: Path, dtype: torch.dtype, device: torch.device
) -> nn.Module:
    model_cls = decoder_class(hf_config)
    assert model_cls is not None  # is_encoder_config said it is a decoder
    model: Any = model_cls(hf_config, dtype=dtype, device=device)
    model.lm_head_weight = None  # embeddings need no logits; headless checkpoints ship no lm_head
    model.load_weights(_without_lm_head(iter_weights(model_dir)))
    return cast(nn.Module, model)


def _without_lm_head(
    weights: Iterable[tuple[str, torch.Tensor]],
) -> Iterator[tuple[str, torch.Tensor]]:
    return ((name, tensor) for name, tensor in weights if not name.startswith("lm_head."))


def _decoder_forward(
    model: Any,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    cu_seqlens: torch.Tensor,
    lora: LoRABatch | None = None,
) -> torch.Tensor:
    """Final-norm hidden states [num_tokens, hidden] of a full causal pass over packed sequences."""
    from engine.kernels.metadata import AttentionMetadata

    device = input_ids.device
    block = _SCRATCH_BLOCK_SIZE
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
    tables: list[list[int]] = []
    num_blocks = 0
    for n in lengths:  # each sequence gets its own run of scratch blocks
        count = -(-n // block)
        tables.append(list(range(num_blocks, num_blocks + count)))
        num_blocks += count
    meta = AttentionMetadata.from_lists(lengths, lengths, tables, block, device)
    param = next(model.parameters())
    scratch = torch.empty(
        (2, num_blocks, block, model.num_kv_heads, model.head_dim),
        dtype=param.dtype,
        device=device,
    )  # [2, num_blocks, block_size, num_kv_heads, head_dim], shared by all layers
    caches = [scratch] * model.num_layers
    if lora is not None:
        return model(input_ids, positions, caches, meta, lora=lora)
    return model(input_ids, positions, caches, meta)  # [num_tokens, hidden]
