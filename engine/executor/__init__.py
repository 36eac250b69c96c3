"""The executor: turns a scheduler output into tensors (a persistent input batch), runs the model over
the paged KV cache (kernels from engine.kernels, CUDA graphs) and samples the next tokens; serves
the LoRA adapters the model's rows may use (lora_adapters)."""
