"""Load a model for serving: checkpoint -> CausalLM in the serving dtype.

The checkpoint is a Hugging Face directory or a GGUF file (cluster/model/checkpoint.py).
Every parameter must be found in it and every tensor it holds must be used. The dtype
follows from the device and, on CPU, from what the CPU can do (cluster/host/cpu_features.py).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from cluster.host.cpu_features import compiler_isa_flags, detect
from cluster.model.checkpoint import Checkpoint, ModelLoadError
from cluster.model.checkpoints import open_checkpoint
from cluster.model.decoder import CausalLM
from cluster.model.families import ModelArch, parse_arch, resolve_max_model_len
from cluster.model.rotary import RotaryEmbedding
from cluster.model.sharding import VOCAB_TENSORS, tensor_slice
from cluster.model.tp_group import SINGLE, TensorParallelGroup
from kernels import cpu as cpu_kernels

log = logging.getLogger(__name__)

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Tensors some checkpoints carry that are derived, not learned.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)

__all__ = ["LoadedModel", "ModelLoadError", "load_model", "resolve_dtype"]


@dataclass(frozen=True)
class LoadedModel:
    model: CausalLM
    arch: ModelArch
    dtype: torch.dtype
    max_model_len: int
    eos_token_ids: frozenset[int]


def resolve_dtype(requested: str, checkpoint_dtype: str | None, device: str) -> torch.dtype:
    """The serving dtype. `auto` on CPU: bfloat16 where the CPU computes it natively
    (AVX-512-BF16 or AMX), else float32 (emulated bf16 is slower than fp32); on GPU the
    checkpoint's half dtype, else bfloat16."""
    cpu = detect()
    if requested != "auto":
        dtype = TORCH_DTYPES[requested]
        if device == "cpu" and dtype == torch.bfloat16 and not cpu.native_bf16:
            log.warning(
                "bfloat16 on a CPU without native bf16 (%s): stored in bf16, computed without oneDNN's "
                "bf16 kernels; --dtype float32 is faster here", cpu.describe()
            )
        return dtype
    if device == "cpu":
        dtype = torch.bfloat16 if cpu.native_bf16 else torch.float32
        why = "native bf16 matmuls" if cpu.native_bf16 else "no native bf16, so float32 is the fastest exact choice"
        log.info("dtype auto -> %s: this CPU has %s (%s)", str(dtype).removeprefix("torch."), cpu.describe(), why)
        return dtype
    named = TORCH_DTYPES.get(str(checkpoint_dtype).removeprefix("torch."))
    return named if named in (torch.bfloat16, torch.float16) else torch.bfloat16


def load_model(
    checkpoint: Checkpoint | str | Path,
    dtype: str = "auto",
    device: str = "cpu",
    max_model_len: int | None = None,
    group: TensorParallelGroup = SINGLE,
) -> LoadedModel:
    """The whole model, or with a tensor-parallel `group` this rank's shard of it (read
    from the checkpoint alone: other ranks' slices are never loaded)."""
    if not isinstance(checkpoint, Checkpoint):
        checkpoint = open_checkpoint(checkpoint)
    if device == "cpu":  # before fuse(): Linear packs its weight for the kernels of this build
        cpu_kernels.configure(compiler_isa_flags(detect()))
    config = checkpoint.config()
    arch = parse_arch(config)
    torch_dtype = resolve_dtype(dtype, arch.torch_dtype, device)
    max_len = resolve_max_model_len(max_model_len, arch)

    with torch.device("meta"):
        model = CausalLM(arch, max_positions=max_len, group=group)
    _materialise(model, device, torch_dtype)
    model.tie_weights()
    for module in model.modules():  # the fp32 rotary table is derived, not loaded
        if isinstance(module, RotaryEmbedding):
            module.rebuild()
    _load_weights(model, checkpoint, arch)
    model.fuse()
    model.eval().requires_grad_(False)
    if device == "cpu":  # built (or found cached) by now, not on the first request
        log.info("CPU ops: %s", cpu_kernels.describe())
    return LoadedModel(model, arch, torch_dtype, max_len, checkpoint.eos_token_ids())


def _materialise(model: torch.nn.Module, device: str, dtype: torch.dtype) -> None:
    """`model.to_empty(device=device).to(dtype)` for a model built on `meta`, without
    meta's empty_like: its Python reference imports sympy, ~1 s of every replica's start.
    Floating-point parameters take `dtype`; buffers keep theirs (their owners rebuild them)."""
    for module in model.modules():
        for name, param in module.named_parameters(recurse=False):
            param_dtype = dtype if param.is_floating_point() else param.dtype
            empty = torch.empty(param.shape, dtype=param_dtype, device=device)
            setattr(module, name, torch.nn.Parameter(empty, requires_grad=param.requires_grad))
        for name, buffer in module.named_buffers(recurse=False):
            setattr(module, name, torch.empty(buffer.shape, dtype=buffer.dtype, device=device))


def _load_weights(model: CausalLM, checkpoint: Checkpoint, arch: ModelArch) -> None:
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    unexpected: list[str] = []
    shard = model.shard
    desc = f"Loading {checkpoint.path.name}" + (f" (rank {shard.rank} of {shard.size})" if shard.size > 1 else "")
    with tqdm(total=checkpoint.num_tensors(), desc=desc, unit="tensor", disable=None) as bar:
        for name, tensor in checkpoint.tensors(lambda n: tensor_slice(n, arch, shard)):
            bar.update()
            if name.endswith(_IGNORED_SUFFIXES) or (name == "lm_head.weight" and arch.tie_word_embeddings):
                continue
            param = params.get(name)
            if param is None:
                unexpected.append(name)
                continue
            rows = tensor.shape[0]
            # The last vocab-parallel shard may have fewer rows than the others: zero-padded.
            padded = name in VOCAB_TENSORS and tensor.shape[1:] == param.shape[1:] and rows < param.shape[0]
            if tensor.shape != param.shape and not padded:
                raise ModelLoadError(f"{name}: checkpoint shape {tuple(tensor.shape)} != model {tuple(param.shape)}")
            if padded:
                param.data.zero_()
                param.data[:rows].copy_(tensor)
            else:
                param.data.copy_(tensor)
            loaded.add(name)
    missing = sorted(set(params) - loaded)
    if missing or unexpected:
        raise ModelLoadError(
            f"checkpoint does not match the architecture: missing {missing[:5]}{'...' if len(missing) > 5 else ''}, "
            f"unexpected {unexpected[:5]}{'...' if len(unexpected) > 5 else ''}"
        )
