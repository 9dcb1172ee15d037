"""Helpers for tests and benchmarks: random checkpoints, GGUF files. Never imported by serving."""
