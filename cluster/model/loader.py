"""Load a Hugging Face model directory: config, generation config, safetensors weights.

Reads `config.json`, `generation_config.json` (optional: eos ids) and the weights from
`model.safetensors` or the shards named in `model.safetensors.index.json`. Every
parameter must be found in the checkpoint and every checkpoint tensor must be used.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm

from cluster.model.decoder import CausalLM
from cluster.model.families import ModelArch, parse_arch
from cluster.model.rotary import RotaryEmbedding

log = logging.getLogger(__name__)

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Tensors some checkpoints carry that are derived, not learned.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class ModelLoadError(RuntimeError):
    pass


@dataclass(frozen=True)
class LoadedModel:
    model: CausalLM
    arch: ModelArch
    dtype: torch.dtype
    max_model_len: int
    eos_token_ids: frozenset[int]


def read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise ModelLoadError(f"{path.name} not found in {path.parent} (expected a Hugging Face model directory)")
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"{path} is not valid JSON: {e}")


def resolve_dtype(requested: str, arch: ModelArch) -> torch.dtype:
    if requested != "auto":
        return TORCH_DTYPES[requested]
    return TORCH_DTYPES.get(str(arch.torch_dtype).removeprefix("torch."), torch.bfloat16)


def resolve_max_model_len(requested: int | None, arch: ModelArch) -> int:
    limit = arch.max_position_embeddings
    if requested is not None and requested > limit:
        raise ModelLoadError(f"max_model_len {requested} exceeds the model's max_position_embeddings {limit}")
    n = requested or limit
    if arch.sliding_window and n > arch.sliding_window:
        # Attention here is full, not windowed: exact only within one window.
        log.warning("capping max_model_len %d to the sliding window %d", n, arch.sliding_window)
        n = arch.sliding_window
    return n


def eos_token_ids(model_dir: Path, config: dict) -> frozenset[int]:
    gen_path = model_dir / "generation_config.json"
    gen = read_json(gen_path) if gen_path.exists() else {}
    eos = gen.get("eos_token_id", config.get("eos_token_id"))
    if eos is None:
        return frozenset()
    return frozenset(eos if isinstance(eos, list) else [eos])


def weight_files(model_dir: Path) -> list[Path]:
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


def load_model(model_dir: str | Path, dtype: str = "auto", device: str = "cpu", max_model_len: int | None = None) -> LoadedModel:
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise ModelLoadError(f"model directory {str(model_dir)!r} does not exist")
    config = read_json(model_dir / "config.json")
    arch = parse_arch(config)
    torch_dtype = resolve_dtype(dtype, arch)
    max_len = resolve_max_model_len(max_model_len, arch)
    files = weight_files(model_dir)

    with torch.device("meta"):
        model = CausalLM(arch, max_positions=max_len)
    model.to_empty(device=device).to(torch_dtype)
    model.tie_weights()
    for module in model.modules():  # the fp32 rotary table is derived, not loaded
        if isinstance(module, RotaryEmbedding):
            module.rebuild()
    _load_weights(model, files, arch)
    model.fuse()
    model.eval().requires_grad_(False)
    return LoadedModel(model, arch, torch_dtype, max_len, eos_token_ids(model_dir, config))


def _load_weights(model: CausalLM, files: list[Path], arch: ModelArch) -> None:
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    unexpected: list[str] = []
    with tqdm(total=len(params), desc="Loading weights", unit="tensor", disable=None) as bar:
        for path in files:
            with safe_open(path, framework="pt") as f:
                for name in f.keys():
                    if name.endswith(_IGNORED_SUFFIXES) or (name == "lm_head.weight" and arch.tie_word_embeddings):
                        continue
                    param = params.get(name)
                    if param is None:
                        unexpected.append(name)
                        continue
                    tensor = f.get_tensor(name)
                    if tensor.shape != param.shape:
                        raise ModelLoadError(f"{name}: checkpoint shape {tuple(tensor.shape)} != model {tuple(param.shape)}")
                    param.data.copy_(tensor)
                    loaded.add(name)
                    bar.update()
    missing = sorted(set(params) - loaded)
    if missing or unexpected:
        raise ModelLoadError(
            f"checkpoint does not match the architecture: missing {missing[:5]}{'...' if len(missing) > 5 else ''}, "
            f"unexpected {unexpected[:5]}{'...' if len(unexpected) > 5 else ''}"
        )
