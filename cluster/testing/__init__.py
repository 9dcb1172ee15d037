"""Helpers for tests and benchmarks: random checkpoints, GGUF files. Never imported by serving."""

# The checkpoints random_checkpoint.make_model writes (here, so the CLI lists them without torch).
ARCHS = ("llama", "mistral", "qwen2", "qwen3")
SIZES = ("tiny", "small", "smollm2")
