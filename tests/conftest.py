"""Shared test set-up. TRITON_INTERPRET must be set before triton is first imported,
so that the Triton kernels can run (interpreted) against CPU tensors."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
