"""Pooling for embedding models: read a sentence-transformers pooling config, pool packed hidden
states (mean / cls / last token per sequence), L2-normalize, and Matryoshka dimension truncation."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import overload

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

POOLING_METHODS = ("mean", "cls", "last")

# The sentence-transformers modules we run, by class name: modules.json spells them
# `sentence_transformers.models.Pooling` (up to v5) or by their v6 module path
# (`sentence_transformers.sentence_transformer.modules.pooling.Pooling`).
_ST_MODULES = ("Transformer", "Pooling", "Normalize")
# 1_Pooling/config.json boolean keys -> our method names; the other modes are not supported.
_ST_MODE_KEYS = {
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_cls_token": "cls",
    "pooling_mode_lasttoken": "last",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len",
    "pooling_mode_weightedmean_tokens": "weightedmean",
}
# Newer sentence-transformers may write `"pooling_mode": "<name>"` instead of the booleans.
_ST_MODE_NAMES = {"mean": "mean", "cls": "cls", "lasttoken": "last", "last": "last"}


@dataclass(frozen=True)
class PoolingConfig:
    method: str  # mean | cls | last
    normalize: bool  # L2-normalize the pooled vector
    include_prompt: bool = True  # False: an instruction prompt's tokens are left out of the pool


def read_pooling_config(model_dir: Path) -> PoolingConfig | None:
    """The pooling a sentence-transformers folder declares, or None if the folder has no modules.json.

    Normalization follows the pipeline: a `Normalize` module means normalized vectors, its absence
    means raw pooled vectors (as `SentenceTransformer.encode` would return them).
    """
    modules_file = Path(model_dir) / "modules.json"
    if not modules_file.is_file():
        return None
    modules = _read_json(modules_file)
    if not isinstance(modules, list):
        raise ValueError(f"{modules_file} must be a JSON list of modules")
    method: str | None = None
    normalize = False
    include_prompt = True
    for module in modules:
        kind = str(module.get("type", ""))
        module_class = _st_module_class(kind)
        if module_class == "Pooling":
            method, include_prompt = _read_pooling_module(
                Path(model_dir) / str(module.get("path", ""))
            )
        elif module_class == "Normalize":
            normalize = True
        elif module_class != "Transformer":
            raise ValueError(
                f"{modules_file} has a module kvserve cannot run ({kind}); only Transformer, "
                "Pooling and Normalize modules are supported"
            )
    if method is None:
        raise ValueError(f"{modules_file} has no Pooling module; pass --pooling mean, cls or last")
    return PoolingConfig(method=method, normalize=normalize, include_prompt=include_prompt)


def _st_module_class(kind: str) -> str | None:
    """Transformer, Pooling or Normalize for a sentence-transformers module type, else None."""
    name = kind.rsplit(".", 1)[-1]
    return name if kind.startswith("sentence_transformers.") and name in _ST_MODULES else None


def _read_json(path: Path) -> object:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"could not read {path}: {e}") from e


def _read_pooling_module(folder: Path) -> tuple[str, bool]:
    """(method, include_prompt) of a Pooling module's config."""
    config_file = folder / "config.json"
    config = _read_json(config_file)
    if not isinstance(config, dict):
        raise ValueError(f"{config_file} must be a JSON object")
    mode = config.get("pooling_mode")
    if isinstance(mode, str):
        modes = [_ST_MODE_NAMES.get(mode, mode)]
    else:
        modes = [name for key, name in _ST_MODE_KEYS.items() if config.get(key)]
    if len(modes) != 1 or modes[0] not in POOLING_METHODS:
        raise ValueError(
            f"{config_file} asks for pooling {'+'.join(modes) or 'none'}; kvserve supports exactly "
            "one of mean, cls or lasttoken; pass --pooling mean, cls or last to override"
        )
    return modes[0], bool(config.get("include_prompt", True))


def resolve_pooling(model_dir: Path, pooling: str, is_encoder: bool) -> PoolingConfig:
    """The pooling to use: an explicit `pooling` wins over the folder's sentence-transformers config,
    which wins over the default (mean for encoders, last token for decoders). Vectors are
    L2-normalized unless the folder's sentence-transformers pipeline has no Normalize module."""
    if pooling not in ("auto", *POOLING_METHODS):
        raise ValueError(f"pooling must be auto, mean, cls or last; got {pooling!r}")
    declared = read_pooling_config(model_dir) if pooling == "auto" else _safe_read(model_dir)
    normalize = declared.normalize if declared is not None else True
    if pooling != "auto":
        include_prompt = declared.include_prompt if declared is not None else True
        return PoolingConfig(pooling, normalize, include_prompt)
    if declared is not None:
        return declared
    return PoolingConfig(method="mean" if is_encoder else "last", normalize=True)


def _safe_read(model_dir: Path) -> PoolingConfig | None:
    """The declared config when only its Normalize flag matters (the method is overridden)."""
    try:
        return read_pooling_config(model_dir)
    except ValueError as e:
        logger.warning("ignoring the pooling config of %s (%s); normalizing", model_dir, e)
        return None


def pool(hidden: torch.Tensor, cu_seqlens: torch.Tensor, method: str) -> torch.Tensor:
    """Pool packed token states per sequence.

    hidden: [num_tokens, hidden]; cu_seqlens: [batch + 1] int offsets of each sequence in `hidden`.
    Returns [batch, hidden] in float32. Each sequence is reduced on its own rows only, so its
    vector does not depend on what else is in the batch.
    """
    hidden = hidden.float()
    if method == "mean":
        lengths = cu_seqlens[1:] - cu_seqlens[:-1]  # [batch]
        return torch.segment_reduce(hidden, "mean", lengths=lengths, axis=0)
    if method == "cls":
        return hidden[cu_seqlens[:-1]]
    if method == "last":
        return hidden[cu_seqlens[1:] - 1]
    raise ValueError(f"pooling must be mean, cls or last; got {method!r}")


def normalize(vectors: torch.Tensor) -> torch.Tensor:
    """L2-normalize the last dimension (a zero vector stays zero)."""
    return F.normalize(vectors, p=2.0, dim=-1)


@overload
def truncate_dimensions(vectors: torch.Tensor, dimensions: int) -> torch.Tensor: ...
@overload
def truncate_dimensions(vectors: list[float], dimensions: int) -> list[float]: ...
@overload
def truncate_dimensions(vectors: list[list[float]], dimensions: int) -> list[list[float]]: ...


def truncate_dimensions(
    vectors: torch.Tensor | list[float] | list[list[float]], dimensions: int
) -> torch.Tensor | list[float] | list[list[float]]:
    """Matryoshka truncation: keep the first `dimensions` values of each vector and re-normalize.

    Accepts a tensor [..., hidden] or a (list of) list of floats and returns the same kind.
    """
    as_list = not isinstance(vectors, torch.Tensor)
    tensor = (
        vectors if isinstance(vectors, torch.Tensor) else torch.tensor(vectors, dtype=torch.float32)
    )
    size = tensor.shape[-1]
    if (
        isinstance(dimensions, bool)
        or not isinstance(dimensions, int)
        or not 1 <= dimensions <= size
    ):
        raise ValueError(f"dimensions must be an integer from 1 to {size}; got {dimensions!r}")
    truncated = normalize(tensor[..., :dimensions])
    if as_list:
        rows: list[float] | list[list[float]] = truncated.tolist()
        return rows
    return truncated
