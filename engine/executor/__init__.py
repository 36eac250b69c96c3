"""The executor: turns a scheduler output into tensors (a persistent input batch), runs the model over
the paged KV cache (attention backends, C++ CPU kernels, CUDA graphs) and samples the next tokens."""
