"""Speculative decoding configuration: vLLM's `--speculative-config` JSON (or dict) parsed into a
frozen SpeculativeConfig, with clear errors for bad values, unknown keys and unsupported methods."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from engine.core.json_config import config_mapping


def _json(value: object) -> str:
    """A config value as the JSON the user wrote (`true`, not Python's `True`)."""
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return repr(value)


SUPPORTED_METHODS = ("ngram", "suffix", "draft_model", "layer_skip")
DRAFT_METHODS = ("draft_model", "layer_skip")  # proposals by a model (greedy), in its own KV
# vLLM's other methods: named in the error so a user knows it is not a typo.
VLLM_METHODS = (
    "eagle",
    "eagle3",
    "medusa",
    "mlp_speculator",
    "mtp",
    "deepseek_mtp",
    "ernie_mtp",
    "qwen3_next_mtp",
    "mimo_mtp",
    "glm4_moe_mtp",
    "longcat_flash_mtp",
)
KEYS = (
    "method",
    "num_speculative_tokens",
    "prompt_lookup_min",
    "prompt_lookup_max",
    "disable_by_batch_size",
    "model",
    "suffix_decoding_max_tree_depth",
    "suffix_decoding_max_cached_requests",
    "suffix_decoding_max_spec_factor",
    "suffix_decoding_min_token_prob",
    "num_draft_layers",
)
SUFFIX_KEYS = KEYS[6:10]
# vLLM keys kvserve accepts only at the value that changes nothing.
NEUTRAL_KEYS = {"draft_tensor_parallel_size": 1, "disable_log_stats": False}
DEFAULT_PROMPT_LOOKUP = 5  # vLLM's ngram default for both bounds when neither is given
MAX_SPECULATIVE_TOKENS = 64
SUFFIX_MAX_TREE_DEPTH = 24  # vLLM's default
# vLLM keeps 10000 requests' outputs (in C++); kvserve's tries are Python objects, so fewer by default.
SUFFIX_MAX_CACHED_REQUESTS = 256


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str = "ngram"
    num_speculative_tokens: int = 3  # tokens proposed per verification step (at most)
    prompt_lookup_min: int = DEFAULT_PROMPT_LOOKUP  # shortest suffix n-gram matched (ngram)
    prompt_lookup_max: int = DEFAULT_PROMPT_LOOKUP  # longest suffix n-gram matched (ngram)
    # No proposals in a step once this many sequences run (None: never disabled by load).
    disable_by_batch_size: int | None = None
    # suffix: trie depth (match + proposal), requests whose outputs the shared trie keeps, proposal
    # length per matched token, and the least estimated chance of a proposed run (vLLM's names).
    suffix_decoding_max_tree_depth: int = SUFFIX_MAX_TREE_DEPTH
    suffix_decoding_max_cached_requests: int = SUFFIX_MAX_CACHED_REQUESTS
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1
    # draft_model: the draft checkpoint (a folder with the target's tokenizer); layer_skip (kvserve's
    # own method, no vLLM equivalent): the target's first num_draft_layers layers as the draft.
    model: str | None = None
    num_draft_layers: int | None = None

    def __post_init__(self) -> None:
        if self.method not in SUPPORTED_METHODS:
            raise ValueError(_method_error(self.method))
        self._check_suffix()
        if self.method == "draft_model" and not (isinstance(self.model, str) and self.model):
            raise ValueError('speculative config: draft_model needs "model" (the draft\'s path)')
        layers = self.num_draft_layers
        if self.method == "layer_skip" and (
            isinstance(layers, bool) or not isinstance(layers, int) or layers < 1
        ):
            raise ValueError(
                f"speculative config: layer_skip needs num_draft_layers, a positive integer, "
                f"got {_json(layers)}"
            )
        for name in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(
                    f"speculative config: {name} must be a positive integer, got {_json(value)}"
                )
        if self.num_speculative_tokens > MAX_SPECULATIVE_TOKENS:
            raise ValueError(
                f"speculative config: num_speculative_tokens must be at most "
                f"{MAX_SPECULATIVE_TOKENS}, got {self.num_speculative_tokens}"
            )
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"speculative config: prompt_lookup_min ({self.prompt_lookup_min}) must not exceed "
                f"prompt_lookup_max ({self.prompt_lookup_max})"
            )
        limit = self.disable_by_batch_size
        if limit is not None and (
            isinstance(limit, bool) or not isinstance(limit, int) or limit < 2
        ):
            raise ValueError(
                f"speculative config: disable_by_batch_size must be an integer of at least 2, got {_json(limit)}"
            )

    def _check_suffix(self) -> None:
        depth, cached = (
            self.suffix_decoding_max_tree_depth,
            self.suffix_decoding_max_cached_requests,
        )
        if isinstance(depth, bool) or not isinstance(depth, int) or not 2 <= depth <= 1024:
            raise ValueError(
                f"speculative config: suffix_decoding_max_tree_depth must be an integer in "
                f"[2, 1024], got {_json(depth)}"
            )
        if isinstance(cached, bool) or not isinstance(cached, int) or cached < 0:
            raise ValueError(
                f"speculative config: suffix_decoding_max_cached_requests must be a non-negative "
                f"integer, got {_json(cached)}"
            )
        factor, prob = self.suffix_decoding_max_spec_factor, self.suffix_decoding_min_token_prob
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not factor > 0:
            raise ValueError(
                f"speculative config: suffix_decoding_max_spec_factor must be a positive number, "
                f"got {_json(factor)}"
            )
        if isinstance(prob, bool) or not isinstance(prob, (int, float)) or not 0 <= prob <= 1:
            raise ValueError(
                f"speculative config: suffix_decoding_min_token_prob must be a number in [0, 1], "
                f"got {_json(prob)}"
            )

    @classmethod
    def parse(
        cls, value: str | Mapping[str, Any] | SpeculativeConfig | None
    ) -> SpeculativeConfig | None:
        """From vLLM's JSON text or a dict (None, '' or 'null': speculation off)."""
        if isinstance(value, SpeculativeConfig):
            return value
        data = config_mapping(
            value, "speculative config", '{"method": "ngram", "num_speculative_tokens": 3}'
        )
        if data is None:
            return None
        return cls._from_mapping(data)

    @classmethod
    def _from_mapping(cls, data: Mapping[str, Any]) -> SpeculativeConfig:
        unknown = [k for k in data if k not in KEYS and k not in NEUTRAL_KEYS]
        if unknown:
            raise ValueError(
                f"speculative config: unknown or unsupported key(s) {', '.join(map(repr, unknown))}; "
                f"kvserve accepts {', '.join(KEYS)}"
            )
        for key, neutral in NEUTRAL_KEYS.items():
            if key in data and data[key] != neutral:
                raise ValueError(
                    f"speculative config: {key} other than {neutral!r} is not supported"
                )
        method, model = data.get("method"), data.get("model")
        if method is None and model is not None:
            method = "ngram" if model in ("[ngram]", "ngram") else "draft_model"
        if method is None:
            raise ValueError(
                f'speculative config needs a "method" (kvserve supports: {", ".join(SUPPORTED_METHODS)})'
            )
        if method == "[ngram]":
            method = "ngram"
        if method == "suffix":
            return cls._suffix(data)
        if method in DRAFT_METHODS:
            return cls._draft(str(method), data)
        if method != "ngram" or model not in (None, "[ngram]", "ngram"):
            raise ValueError(_method_error(str(method)))
        misplaced = [k for k in (*SUFFIX_KEYS, "num_draft_layers") if k in data]
        if misplaced:
            raise ValueError(f"speculative config: {misplaced[0]} does not apply to method ngram")
        if "num_speculative_tokens" not in data:
            raise ValueError("speculative config: ngram needs num_speculative_tokens")
        low: Any = data.get("prompt_lookup_min")
        high: Any = data.get("prompt_lookup_max")
        if low is None and high is None:
            low = high = DEFAULT_PROMPT_LOOKUP
        elif low is None:
            low = high
        elif high is None:
            high = low
        return cls(
            method=method,
            num_speculative_tokens=data["num_speculative_tokens"],
            prompt_lookup_min=low,
            prompt_lookup_max=high,
            disable_by_batch_size=data.get("disable_by_batch_size"),
        )

    @classmethod
    def _suffix(cls, data: Mapping[str, Any]) -> SpeculativeConfig:
        misplaced = [
            k
            for k in ("prompt_lookup_min", "prompt_lookup_max", "num_draft_layers", "model")
            if k in data
        ]
        if misplaced:
            raise ValueError(f"speculative config: {misplaced[0]} does not apply to method suffix")
        depth = data.get("suffix_decoding_max_tree_depth", SUFFIX_MAX_TREE_DEPTH)
        # vLLM's default: proposals as long as the trie allows
        k = data.get("num_speculative_tokens", depth)
        if isinstance(k, int) and not isinstance(k, bool) and isinstance(depth, int):
            k = min(k, MAX_SPECULATIVE_TOKENS) if "num_speculative_tokens" not in data else k
        return cls(
            method="suffix",
            num_speculative_tokens=k,
            disable_by_batch_size=data.get("disable_by_batch_size"),
            **{key: data[key] for key in SUFFIX_KEYS if key in data},
        )

    @classmethod
    def _draft(cls, method: str, data: Mapping[str, Any]) -> SpeculativeConfig:
        allowed = {"method", "model", "num_speculative_tokens", "disable_by_batch_size"}
        if method == "layer_skip":
            allowed = (allowed - {"model"}) | {"num_draft_layers"}
        misplaced = [k for k in data if k in KEYS and k not in allowed]
        if misplaced:
            raise ValueError(
                f"speculative config: {misplaced[0]} does not apply to method {method}"
            )
        if "num_speculative_tokens" not in data:
            raise ValueError(f"speculative config: {method} needs num_speculative_tokens")
        return cls(
            method=method,
            num_speculative_tokens=data["num_speculative_tokens"],
            disable_by_batch_size=data.get("disable_by_batch_size"),
            model=data.get("model"),
            num_draft_layers=data.get("num_draft_layers"),
        )


def _method_error(method: str) -> str:
    if method in VLLM_METHODS:
        return (
            f"speculative method {method!r} is not supported by kvserve; supported: "
            f"{', '.join(SUPPORTED_METHODS)}"
        )
    return (
        f"unknown speculative method {method!r}; kvserve supports {', '.join(SUPPORTED_METHODS)} "
        f"(vLLM's others, not supported here: {', '.join(VLLM_METHODS)})"
    )
