"""Kernels: the attention backends (torch SDPA, C++ CPU, Triton, flash-attn) and the C++ CPU kernels
(csrc/: paged decode attention, fused norms, rotary and SwiGLU, block-quantized matmuls) with their
loader, the KV cache's element type (kv_dtype), and the child-process probe that says whether
AMX-INT8 runs (amx_probe).
The executor calls them; they know nothing of scheduling or requests."""
