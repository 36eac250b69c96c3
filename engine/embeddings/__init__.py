"""Embedding models: a KV-free engine core that batches whole inputs, the encoder/decoder embedding
model adapter, and pooling."""
