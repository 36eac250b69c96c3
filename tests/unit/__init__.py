"""Unit tests: no model, milliseconds (the server over fake engines, the torch-free core)."""
