"""The executor: turns a scheduler output into tensors, runs the model over the paged KV cache
(attention backends, CUDA graphs) and samples the next tokens."""
