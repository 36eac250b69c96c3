"""Building blocks every decoder family shares: RMSNorm (Llama's and Gemma's (1 + weight) form),
the gated MLP (SwiGLU or GELU-tanh), logit softcapping and uninitialized parameters."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.kernels import cpu_kernels
from engine.models.lora_apply import LayerLoRA, add_lora
from engine.models.quantization import linear

ACTIVATIONS = ("silu", "gelu_pytorch_tanh", "gelu_tanh")


class RMSNorm(nn.Module):
    """Llama form: normalize in float32, scale in the model dtype (as the Hugging Face reference
    does). Gemma form (`unit_offset`): scale by (1 + weight) in float32, then round once."""

    def __init__(
        self,
        hidden_size: int,
        eps: float,
        dtype: torch.dtype,
        device: torch.device,
        unit_offset: bool = False,
    ):
        super().__init__()
        self.weight = nn.Parameter(
            torch.ones(hidden_size, dtype=dtype, device=device), requires_grad=False
        )
        self.eps = eps
        self.hidden_size = hidden_size
        self.unit_offset = unit_offset
        self._kernel_weight: torch.Tensor | None = None  # see kernel_weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., hidden] -> [..., hidden]
        if self.unit_offset:
            normed = F.rms_norm(x.float(), (self.hidden_size,), eps=self.eps)
            return (normed * (1.0 + self.weight.float())).to(x.dtype)
        # torch's rms_norm accumulates bf16/fp16 input in float32 and rounds once, which is
        # bitwise what upcasting first gives, in two ops fewer.
        normed = F.rms_norm(x, (self.hidden_size,), eps=self.eps)
        return self.weight * normed

    def kernel_weight(self) -> torch.Tensor | None:
        """The weight the C++ rms_norm (weight * round(normalized x)) takes to give this norm's
        values: the weight itself, or (1 + weight) for a float32 Gemma norm (rounding is then a
        no-op); None where the kernel would round differently (Gemma form in 16-bit dtypes)."""
        if not self.unit_offset:
            return self.weight
        if self.weight.dtype != torch.float32:
            return None
        if self._kernel_weight is None or self._kernel_weight.device != self.weight.device:
            self._kernel_weight = 1.0 + self.weight.detach()
        return self._kernel_weight

    def weights_changed(self) -> None:
        self._kernel_weight = None


def empty_param(*shape: int, dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    """An uninitialized parameter (weights are always loaded from a checkpoint afterwards)."""
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


def optional_param(
    *shape: int, dtype: torch.dtype, device: torch.device, enabled: bool
) -> nn.Parameter | None:
    """`empty_param` when the checkpoint has this tensor (biases, an untied head), else None."""
    return empty_param(*shape, dtype=dtype, device=device) if enabled else None


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)), with gate and up as one matmul; act is SiLU (SwiGLU: Llama,
    Qwen, Phi) or tanh-approximated GELU (Gemma)."""

    def __init__(
        self,
        hidden: int,
        inter: int,
        activation: str,
        bias: bool,
        dtype: torch.dtype,
        device: torch.device,
    ):
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(
                f"hidden activation {activation!r} is not supported; kvserve supports "
                f"{', '.join(ACTIVATIONS)}"
            )
        self.gelu = activation != "silu"
        self.intermediate_size = inter
        self.gate_up_weight = empty_param(2 * inter, hidden, dtype=dtype, device=device)
        self.gate_up_bias = optional_param(2 * inter, dtype=dtype, device=device, enabled=bias)
        self.down_weight = empty_param(hidden, inter, dtype=dtype, device=device)
        self.down_bias = optional_param(hidden, dtype=dtype, device=device, enabled=bias)

    def forward(
        self, x: torch.Tensor, lora: LayerLoRA | None = None
    ) -> torch.Tensor:  # [n, hidden] -> [n, hidden]
        gate_up = linear(x, self.gate_up_weight, self.gate_up_bias)  # [n, 2 * inter]
        add_lora(gate_up, x, lora, "gate_up")
        if self._one_pass_silu(gate_up):
            hidden = cpu_kernels.silu_mul(gate_up)  # csrc/decode_layer.cpp does the same
        else:
            gate, up = gate_up.split(self.intermediate_size, dim=-1)
            act = F.gelu(gate, approximate="tanh") if self.gelu else F.silu(gate)
            hidden = act * up
        return add_lora(linear(hidden, self.down_weight, self.down_bias), hidden, lora, "down")

    def _one_pass_silu(self, gate_up: torch.Tensor) -> bool:
        """SwiGLU over block-quantized weights on CPU takes the C++ one-pass activation (its own
        exp: not torch's bits, which float weights keep so they stay transformers' arithmetic)."""
        return (
            not self.gelu
            and not isinstance(self.gate_up_weight, torch.Tensor)
            and gate_up.dtype == torch.float32
            and gate_up.device.type == "cpu"
            and cpu_kernels.available()
        )


def softcap(x: torch.Tensor, cap: float | None) -> torch.Tensor:
    """Gemma's logit softcapping, cap * tanh(x / cap), as transformers computes it; None = off."""
    if cap is None:
        return x
    return torch.tanh(x / cap) * cap
