"""open_checkpoint(path): the Checkpoint reader a model path needs (checkpoint.py: the
interface and Hugging Face directories; gguf_checkpoint.py: GGUF files). Torch-free: the
gateway opens checkpoints for their config and tokenizer alone."""

from __future__ import annotations

from pathlib import Path

from cluster.config import GGUF_SUFFIX
from cluster.model.checkpoint import Checkpoint, HFCheckpoint, ModelLoadError
from cluster.model.gguf_checkpoint import GGUFCheckpoint


def open_checkpoint(model: str | Path) -> Checkpoint:
    """A Hugging Face model directory, or a `.gguf` file."""
    path = Path(model).expanduser()
    if path.suffix == GGUF_SUFFIX:
        if not path.is_file():
            raise ModelLoadError(f"GGUF file {str(path)!r} does not exist")
        return GGUFCheckpoint(path)
    if not path.exists():
        raise ModelLoadError(f"model directory {str(path)!r} does not exist")
    if not path.is_dir():
        raise ModelLoadError(f"model {str(path)!r} is neither a model directory nor a .gguf file")
    return HFCheckpoint(path)
