"""LoRA adapters, torch-free: the engine's LoRA config (adapters named at start, per-step and rank
limits), a served adapter's public description, and the reading and checking of a PEFT folder's
`adapter_config.json` (the tensors are loaded by engine/models/lora_weights.py)."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from engine.core.errors import LoRAError

ADAPTER_CONFIG = "adapter_config.json"
SAFETENSORS_FILE = "adapter_model.safetensors"
BIN_FILE = "adapter_model.bin"

# PEFT's module names for the linears of a decoder layer, as the engine's model code names them.
# Fused checkpoints (Phi-3) name their fused linears themselves (qkv_proj, gate_up_proj).
PEFT_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
FUSED_LINEARS = ("qkv_proj", "gate_up_proj")
# PEFT's shorthand targets that name every linear (except the output head).
ALL_LINEAR = "all-linear"
_REFUSED_TARGETS = ("embed_tokens", "lm_head", "wte", "embed_in", "embed_out")


def _parse_module(item: object) -> tuple[str, str]:
    if isinstance(item, tuple | list) and len(item) == 2:
        name, path = item
    elif isinstance(item, Mapping):
        name, path = item.get("name"), item.get("path")
    elif isinstance(item, str):
        text = item.strip()
        if text.startswith("{"):  # vLLM's JSON form {"name": ..., "path": ...}
            try:
                return _parse_module(json.loads(text))
            except json.JSONDecodeError as exc:
                raise ValueError(f"lora module {item!r} is not valid JSON: {exc}") from None
        name, sep, path = text.partition("=")
        if not sep:
            raise ValueError(f"lora module {item!r} must be name=path")
    else:
        raise ValueError(f"lora module {item!r} must be name=path or a (name, path) pair")
    if not isinstance(name, str) or not isinstance(path, str):
        raise ValueError(f"lora module {item!r} needs a string name and path")
    return check_lora_name(name.strip()), path.strip()


def check_lora_name(name: str) -> str:
    """An adapter's served name: non-empty, no whitespace, no ':' (SGLang's "base:name" form)."""
    if not name or any(c.isspace() for c in name) or ":" in name:
        raise LoRAError(
            f"invalid LoRA name {name!r}: it must be non-empty with no spaces or ':'", "lora_name"
        )
    return name


def parse_lora_modules(value: object) -> tuple[tuple[str, str], ...]:
    """`lora_modules` as given: None, "name=path", a JSON object, a (name, path) pair, a dict of
    name -> path, or a sequence of those."""
    if value is None:
        return ()
    items: Iterable[object]
    if isinstance(value, str):
        items = [value]
    elif isinstance(value, Mapping) and "path" not in value:
        items = list(value.items())
    elif isinstance(value, tuple) and len(value) == 2 and all(isinstance(v, str) for v in value):
        items = [value]
    elif isinstance(value, Iterable):
        items = value
    else:
        raise ValueError(f"lora_modules must be name=path entries; got {value!r}")
    modules = tuple(_parse_module(item) for item in items)
    names = [name for name, _ in modules]
    for name in names:
        if names.count(name) > 1:
            raise ValueError(f"lora module name {name!r} is given twice")
        if not modules[names.index(name)][1]:
            raise ValueError(f"lora module {name!r} has an empty path")
    return modules


@dataclass(frozen=True)
class LoRAConfig:
    # Adapters loaded at start-up: (served name, PEFT folder).
    modules: tuple[tuple[str, str], ...] = ()
    max_loras: int = 4  # distinct adapters in one step (vLLM's meaning)
    max_lora_rank: int = 64

    def __post_init__(self) -> None:
        object.__setattr__(self, "modules", parse_lora_modules(self.modules))
        if not isinstance(self.max_loras, int) or self.max_loras < 1:
            raise ValueError(f"max_loras must be a positive integer; got {self.max_loras!r}")
        if not isinstance(self.max_lora_rank, int) or self.max_lora_rank < 1:
            raise ValueError(
                f"max_lora_rank must be a positive integer; got {self.max_lora_rank!r}"
            )


@dataclass(frozen=True)
class LoRAInfo:
    """A served adapter, as the front end lists it."""

    name: str
    path: str
    rank: int
    alpha: float
    target_modules: tuple[str, ...]  # the engine's linear names the adapter changes
    content_hash: str  # sha256 of the loaded tensors and scaling: the prefix-cache namespace
    created: int  # unix seconds when it was loaded


@dataclass(frozen=True)
class AdapterSpec:
    """A PEFT LoRA folder's checked `adapter_config.json`."""

    path: str
    rank: int
    alpha: float
    use_rslora: bool
    target_modules: tuple[str, ...]  # as PEFT lists them (suffixes of module names), or all-linear
    weights_file: str

    @property
    def scaling(self) -> float:
        """PEFT's factor on B @ A: alpha / r, or alpha / sqrt(r) with rsLoRA."""
        return self.alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)


def _bad(path: str, why: str) -> LoRAError:
    return LoRAError(f"LoRA adapter at {path!r}: {why}", "lora_path")


def _read_json(path: str) -> dict[str, object]:
    config_path = os.path.join(path, ADAPTER_CONFIG)
    if not os.path.isdir(path):
        raise _bad(path, "no such folder")
    if not os.path.isfile(config_path):
        raise _bad(path, f"not a PEFT adapter folder (no {ADAPTER_CONFIG})")
    try:
        with open(config_path, encoding="utf-8") as f:
            raw = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise _bad(path, f"{ADAPTER_CONFIG} is not valid JSON ({exc})") from None
    if not isinstance(raw, dict):
        raise _bad(path, f"{ADAPTER_CONFIG} is not a JSON object")
    return raw


def _targets(path: str, raw: Mapping[str, object]) -> tuple[str, ...]:
    targets = raw.get("target_modules")
    if isinstance(targets, str):
        if targets != ALL_LINEAR:
            # PEFT reads a string as a regex over full module names; only its plain names are served.
            raise _bad(path, f"target_modules as a regex ({targets!r}) is not supported")
        return (ALL_LINEAR,)
    if not isinstance(targets, list) or not targets or not all(isinstance(t, str) for t in targets):
        raise _bad(path, "target_modules must be a non-empty list of module names")
    names = tuple(sorted({t.rsplit(".", 1)[-1] for t in targets}))
    refused = [t for t in names if t in _REFUSED_TARGETS]
    if refused or raw.get("modules_to_save"):
        what = ", ".join(refused) or f"modules_to_save {raw.get('modules_to_save')}"
        raise _bad(path, f"LoRA on the embedding or output head ({what}) is not supported")
    return names


def read_adapter_spec(path: str, max_lora_rank: int) -> AdapterSpec:
    """Read and check a PEFT LoRA folder's config; LoRAError (param "lora_path") says what is wrong."""
    raw = _read_json(path)
    if str(raw.get("peft_type", "")).upper() != "LORA":
        raise _bad(path, f"peft_type is {raw.get('peft_type')!r}, not LORA")
    if raw.get("use_dora"):
        raise _bad(path, "DoRA adapters (use_dora) are not supported")
    for key in ("rank_pattern", "alpha_pattern"):
        if raw.get(key):
            raise _bad(path, f"per-module ranks or alphas ({key}) are not supported")
    if raw.get("layers_to_transform") is not None:
        raise _bad(path, "layers_to_transform is not supported")
    rank, alpha = raw.get("r"), raw.get("lora_alpha", raw.get("r"))
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise _bad(path, f"r must be a positive integer; got {rank!r}")
    if rank > max_lora_rank:
        raise _bad(path, f"rank {rank} is above the maximum LoRA rank {max_lora_rank}")
    if not isinstance(alpha, int | float) or isinstance(alpha, bool) or not math.isfinite(alpha):
        raise _bad(path, f"lora_alpha must be a number; got {alpha!r}")
    if str(raw.get("bias", "none")) != "none":
        raise _bad(path, f"bias={raw.get('bias')!r} is not supported (only 'none')")
    weights = os.path.join(path, SAFETENSORS_FILE)
    if not os.path.isfile(weights):
        if os.path.isfile(os.path.join(path, BIN_FILE)):
            raise _bad(path, f"only {SAFETENSORS_FILE} is read ({BIN_FILE} is a pickle)")
        raise _bad(path, f"no {SAFETENSORS_FILE}")
    return AdapterSpec(
        path=path,
        rank=rank,
        alpha=float(alpha),
        use_rslora=bool(raw.get("use_rslora", False)),
        target_modules=_targets(path, raw),
        weights_file=weights,
    )
