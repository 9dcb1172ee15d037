"""Where a model comes from: a Hugging Face directory or a GGUF file, read alike.

    Checkpoint (checkpoints.open_checkpoint(path) picks the kind)
        .config()          Hugging Face config.json fields (a GGUF's are mapped from its metadata)
        .eos_token_ids()   every token that ends a generation
        .tokenizer()       the serving Tokenizer
        .tensors(select)   (Hugging Face parameter name, tensor), each read once, in file order;
                           `select(name)` -> (dim, start, stop) reads only that slice (a
                           tensor-parallel rank's shard), None the whole tensor;
                 (keep=...)  a 2-D tensor stored in one of the `keep` formats (GGUF's Q4_0,
                           Q4_1, Q8_0) comes as a QuantizedTensor: its blocks as stored

Everything above this module (the loader, the engine, the gateway's input processor)
sees only this interface, so a new format is one new class here.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from safetensors import safe_open

from cluster.text.tokenizer import Tokenizer

if TYPE_CHECKING:  # torch is imported by whoever reads tensors: the gateway reads configs, torch-free
    import torch


class ModelLoadError(RuntimeError):
    pass


Slice = tuple[int, int, int]  # (dimension, start, stop)
SliceSelector = Callable[[str], Slice | None]


@dataclass(frozen=True)
class QuantizedTensor:
    """A 2-D tensor as a GGUF file stores it: each row of `shape[1]` values as the format's
    blocks of 32 (rows: uint8 [shape[0], bytes per row]); kernels/quantized.py packs it."""

    fmt: str  # "Q4_0", "Q4_1" or "Q8_0"
    rows: torch.Tensor
    shape: tuple[int, int]


def read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise ModelLoadError(f"{path.name} not found in {path.parent} (expected a Hugging Face model directory)") from None
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"{path} is not valid JSON: {e}") from None


class Checkpoint:
    path: Path

    def config(self) -> dict:
        raise NotImplementedError

    def eos_token_ids(self) -> frozenset[int]:
        raise NotImplementedError

    def tokenizer(self) -> Tokenizer:
        raise NotImplementedError

    def num_tensors(self) -> int:
        raise NotImplementedError

    def quantized_formats(self) -> frozenset[str]:
        """The quantized formats its tensors are stored in (what `tensors(keep=...)` can keep)."""
        return frozenset()

    def tensors(self, select: SliceSelector | None = None,
                keep: frozenset[str] = frozenset()) -> Iterator[tuple[str, torch.Tensor | QuantizedTensor]]:
        raise NotImplementedError


class HFCheckpoint(Checkpoint):
    """`config.json`, `generation_config.json` (optional: eos ids), the tokenizer files, and
    weights in `model.safetensors` or the shards `model.safetensors.index.json` names."""

    def __init__(self, model_dir: Path):
        self.path = model_dir
        self._config = read_json(model_dir / "config.json")

    def config(self) -> dict:
        return self._config

    def eos_token_ids(self) -> frozenset[int]:
        gen_path = self.path / "generation_config.json"
        gen = read_json(gen_path) if gen_path.exists() else {}
        eos = gen.get("eos_token_id", self._config.get("eos_token_id"))
        if eos is None:
            return frozenset()
        return frozenset(eos if isinstance(eos, list) else [eos])

    def tokenizer(self) -> Tokenizer:
        return Tokenizer.from_pretrained(self.path)

    def num_tensors(self) -> int:
        total = 0
        for path in _weight_files(self.path):
            with safe_open(path, framework="pt") as f:
                total += len(f.keys())
        return total

    def tensors(self, select: SliceSelector | None = None,
                keep: frozenset[str] = frozenset()) -> Iterator[tuple[str, torch.Tensor]]:
        for path in _weight_files(self.path):  # nothing here is stored quantized: `keep` has nothing to keep
            with safe_open(path, framework="pt") as f:
                for name in f.keys():
                    part = select(name) if select else None
                    if part is None:
                        yield name, f.get_tensor(name)
                        continue
                    dim, start, stop = part  # safetensors reads only the slice from the file
                    stored = f.get_slice(name)
                    yield name, stored[start:stop] if dim == 0 else stored[:, start:stop]


def _weight_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        shards = sorted(set(read_json(index)["weight_map"].values()))
        missing = [s for s in shards if not (model_dir / s).exists()]
        if missing:
            raise ModelLoadError(f"shards listed in {index.name} are missing: {', '.join(missing)}")
        return [model_dir / s for s in shards]
    single = model_dir / "model.safetensors"
    if single.exists():
        return [single]
    raise ModelLoadError(
        f"no weights in {model_dir}: expected model.safetensors or model.safetensors.index.json "
        "(only safetensors checkpoints are supported)"
    )
