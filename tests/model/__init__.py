"""Model tests: the engine on tiny random-weight checkpoints, against the transformers reference."""
