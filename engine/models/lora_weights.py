"""A PEFT LoRA adapter's tensors loaded for the shared decoder: each `lora_A`/`lora_B` pair mapped onto
the engine's (fused) linears, checked against the model's shapes, kept in float32 with the scaling
folded into B, and hashed by content (the adapter's prefix-cache namespace)."""

from __future__ import annotations

import hashlib
import re
import time
from typing import Any

import torch

from engine.core.errors import LoRAError
from engine.core.lora import ALL_LINEAR, AdapterSpec, LoRAInfo
from engine.models.layers import GatedMLP
from engine.models.lora_apply import LinearLoRA, LoRAAdapter, LoRAPiece

# The engine's linears of a decoder layer (the fused parameter each one multiplies by).
LINEARS = {
    "self_attn.qkv_weight": "qkv",
    "self_attn.o_weight": "o",
    "mlp.gate_up_weight": "gate_up",
    "mlp.down_weight": "down",
}
_KEY = re.compile(r"(?:.*\.)?layers\.(\d+)\.(.+)\.lora_([AB])(?:\.[^.]+)?\.weight")
_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def linear_shapes(model: Any) -> dict[str, tuple[int, int]]:
    """Each engine linear's (out_features, in_features)."""
    q = model.num_heads * model.head_dim
    kv = model.num_kv_heads * model.head_dim
    hidden, inter = model.hidden_size, model.spec.intermediate_size
    return {
        "qkv": (q + 2 * kv, hidden),
        "o": (hidden, q),
        "gate_up": (2 * inter, hidden),
        "down": (hidden, inter),
    }


def peft_modules(model: Any) -> dict[str, tuple[str, int]]:
    """PEFT module path inside a layer (`self_attn.q_proj`) -> (engine linear, first output row),
    from the model's own checkpoint names (so Phi-3's fused qkv_proj / gate_up_proj map too). A
    layer whose MLP is not the gated MLP (mixture of experts) takes attention adapters only."""
    dense_mlp = isinstance(model.layers[0].mlp, GatedMLP)
    found: dict[str, tuple[str, int]] = {}
    for name, (param, offset) in model.layer_tensor_names().items():
        linear = LINEARS.get(param)
        if linear is None or not name.endswith(".weight"):
            continue
        if linear in ("gate_up", "down") and not dense_mlp:
            continue
        found[name.removesuffix(".weight")] = (linear, offset)
    return found


FUSED_MODULES = ("qkv_proj", "gate_up_proj")  # checkpoint names of whole fused linears (Phi-3)


def module_rows(
    modules: dict[str, tuple[str, int]], shapes: dict[str, tuple[int, int]]
) -> dict[str, int]:
    """Each PEFT module's output rows: from its first row to the next split module's of the same
    engine linear (q | k | v in qkv), or to the linear's end (the last, or a fused module such as
    Phi-3's qkv_proj, stored beside the split names that map into the same linear)."""
    starts: dict[str, list[int]] = {}
    for module, (linear, offset) in modules.items():
        if module.rsplit(".", 1)[-1] not in FUSED_MODULES:
            starts.setdefault(linear, []).append(offset)
    rows: dict[str, int] = {}
    for module, (linear, offset) in modules.items():
        fused = module.rsplit(".", 1)[-1] in FUSED_MODULES
        later = [] if fused else [o for o in starts[linear] if o > offset]
        rows[module] = (min(later) if later else shapes[linear][0]) - offset
    return rows


def _bad(spec: AdapterSpec, why: str) -> LoRAError:
    return LoRAError(f"LoRA adapter at {spec.path!r}: {why}", "lora_path")


def _read_tensors(spec: AdapterSpec) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(spec.weights_file)
    except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
        raise _bad(spec, f"the weights file is not a readable safetensors file ({exc})") from None


def content_hash(tensors: dict[str, torch.Tensor], scaling: float) -> str:
    """sha256 of every tensor's name, dtype, shape and bytes (in name order) and the scaling."""
    digest = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        digest.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        digest.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    digest.update(repr(float(scaling)).encode())
    return digest.hexdigest()


def _check_targets(spec: AdapterSpec, modules: dict[str, tuple[str, int]]) -> None:
    if spec.target_modules == (ALL_LINEAR,):
        return
    known = {m.rsplit(".", 1)[-1] for m in modules}
    missing = [t for t in spec.target_modules if t not in known]
    if missing:
        raise _bad(
            spec,
            f"target modules {', '.join(missing)} are not linears of this model "
            f"(it has {', '.join(sorted(known))})",
        )


def _pairs(
    spec: AdapterSpec, tensors: dict[str, torch.Tensor], num_layers: int
) -> dict[tuple[int, str], dict[str, torch.Tensor]]:
    """(layer, PEFT module path) -> {"A": lora_A, "B": lora_B}."""
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _KEY.fullmatch(key)
        if match is None:
            if "lora_embedding" in key or "lora_magnitude" in key:
                raise _bad(spec, f"{key}: embedding LoRA and DoRA are not supported")
            raise _bad(spec, f"unexpected tensor {key} (not a lora_A / lora_B weight)")
        layer = int(match[1])
        if layer >= num_layers:
            raise _bad(spec, f"{key} is for layer {layer}; the model has {num_layers} layers")
        if tensor.dtype not in _FLOATS:
            raise _bad(spec, f"{key} has dtype {tensor.dtype}; LoRA weights must be floating point")
        pairs.setdefault((layer, match[2]), {})[match[3]] = tensor
    if not pairs:
        raise _bad(spec, "the weights file holds no LoRA tensors")
    return pairs


def _piece(
    spec: AdapterSpec,
    where: str,
    pair: dict[str, torch.Tensor],
    out_rows: int,
    in_features: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The checked (lora_A [r, in], lora_B [out, r]) of one module, in float32."""
    if set(pair) != {"A", "B"}:
        raise _bad(spec, f"{where} has lora_{''.join(pair)} but not its pair")
    a, b = pair["A"], pair["B"]
    if a.dim() != 2 or b.dim() != 2:
        raise _bad(spec, f"{where}: lora_A and lora_B must be matrices")
    if a.shape[0] != spec.rank or b.shape[1] != spec.rank:
        raise _bad(
            spec, f"{where}: shapes {tuple(a.shape)}, {tuple(b.shape)} are not rank {spec.rank}"
        )
    if a.shape[1] != in_features or b.shape[0] != out_rows:
        raise _bad(
            spec,
            f"{where}: lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} do not fit this model "
            f"(input {in_features}, output {out_rows}): an adapter for another base model?",
        )
    a32, b32 = a.float(), b.float()
    if not (torch.isfinite(a32).all() and torch.isfinite(b32).all()):
        raise _bad(spec, f"{where} holds non-finite values")
    return a32, b32


def load_adapter(model: Any, spec: AdapterSpec, name: str, lora_id: int) -> LoRAAdapter:
    """Read, check and lay out a PEFT adapter for `model` (a DecoderForCausalLM); LoRAError names
    what is wrong. Touches nothing the engine serves."""
    if not hasattr(model, "layer_tensor_names") or not hasattr(model, "spec"):
        raise LoRAError(f"{type(model).__name__} does not take LoRA adapters", "lora_path")
    modules = peft_modules(model)
    _check_targets(spec, modules)
    tensors = _read_tensors(spec)
    pairs = _pairs(spec, tensors, model.num_layers)
    shapes = linear_shapes(model)
    rows = module_rows(modules, shapes)
    scaling = spec.scaling
    device = model.norm.weight.device  # the adapter lives beside the model (float32)
    grouped: list[dict[str, list[tuple[int, torch.Tensor, torch.Tensor, str]]]] = [
        {} for _ in range(model.num_layers)
    ]
    targets: set[str] = set()
    for (layer, module), pair in sorted(pairs.items()):
        where = f"layers.{layer}.{module}"
        mapped = modules.get(module)
        if mapped is None:
            raise _bad(spec, f"{where} is not a linear this model has LoRA support for")
        linear, offset = mapped
        a, b = _piece(spec, where, pair, rows[module], shapes[linear][1])
        grouped[layer].setdefault(linear, []).append((offset, a, b, module))
        targets.add(module.rsplit(".", 1)[-1])
    layers: list[dict[str, LinearLoRA]] = []
    for per_layer in grouped:
        linears: dict[str, LinearLoRA] = {}
        for linear, parts in per_layer.items():
            parts.sort(key=lambda part: part[0])  # by first output
            a = torch.cat([a for _, a, _, _ in parts], dim=0).to(device).contiguous()  # [sum r, in]
            pieces: list[LoRAPiece] = []
            col = 0
            for offset, _, b, _ in parts:
                if pieces and offset < pieces[-1].out_start + pieces[-1].b.shape[0]:
                    raise _bad(spec, f"layers.{len(layers)}: two modules change the same outputs")
                scaled = (b * scaling).to(device).contiguous()
                pieces.append(LoRAPiece(col, b.shape[1], offset, scaled))
                col += b.shape[1]
            linears[linear] = LinearLoRA(a, pieces)
        layers.append(linears)
    info = LoRAInfo(
        name=name,
        path=spec.path,
        rank=spec.rank,
        alpha=spec.alpha,
        target_modules=tuple(sorted(targets)),
        content_hash=content_hash(tensors, scaling),
        created=int(time.time()),
    )
    return LoRAAdapter(info, lora_id, layers)
