"""Load a model for serving: checkpoint -> CausalLM in the serving dtype.

The checkpoint is a Hugging Face directory or a GGUF file (cluster/model/checkpoint.py).
Every parameter must be found in it and every tensor it holds must be used. The dtype
follows from the device and, on CPU, from what the CPU can do (cluster/host/cpu_features.py).

A GGUF file's Q4_0, Q4_1 and Q8_0 linears and embedding stay in their blocks on CPU
(`quantization="auto"`, the C kernels built; a TP rank its shard's): the kernels read them as they are
(kernels/quantized.py), and the activations are float32 unless --dtype says otherwise.
`quantization="q8_0"` or `"q4_0"` also quantizes every other linear and embedding weight
(a Hugging Face checkpoint's, a GGUF file's K-quants) at load, with gguf's own quantizer;
`"none"` dequantizes every tensor at load, to the serving dtype.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch
from gguf import GGMLQuantizationType
from gguf.quants import quantize as gguf_quantize
from tqdm import tqdm

from cluster.config import QUANTIZATIONS
from cluster.host.cpu_features import compiler_isa_flags, detect
from cluster.model.checkpoint import Checkpoint, ModelLoadError, QuantizedTensor
from cluster.model.checkpoints import open_checkpoint
from cluster.model.decoder import CausalLM
from cluster.model.families import ModelArch, parse_arch, resolve_max_model_len
from cluster.model.quantized_holder import HoldsQuantizedWeight
from cluster.model.rotary import RotaryEmbedding
from cluster.model.sharding import VOCAB_TENSORS, tensor_slice
from cluster.model.tp_group import SINGLE, TensorParallelGroup
from kernels import cpu as cpu_kernels
from kernels import quantized

log = logging.getLogger(__name__)

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Tensors some checkpoints carry that are derived, not learned.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)

__all__ = ["LoadedModel", "ModelLoadError", "QuantizedLoad", "load_model", "quantized_load", "resolve_dtype", "serving_dtype"]


@dataclass(frozen=True)
class LoadedModel:
    model: CausalLM
    arch: ModelArch
    dtype: torch.dtype
    max_model_len: int
    eos_token_ids: frozenset[int]


def resolve_dtype(requested: str, checkpoint_dtype: str | None, device: str, quantized_weights: bool = False) -> torch.dtype:
    """The serving dtype. `auto` on CPU: float32 with quantized weights (the kernel multiplies
    them in float32 whatever the activations' dtype, and float32 activations and residual
    stream decide near-ties as the float32 reference does, where bf16 tipped the built-in
    model's answers; prefill and big batches pay float32's FMAs: docs/benchmarks.md);
    otherwise bfloat16 where the CPU computes it natively (AVX-512-BF16 or AMX), else float32
    (emulated bf16 is slower than fp32); on GPU the checkpoint's half dtype, else bfloat16."""
    cpu = detect()
    if requested != "auto":
        dtype = TORCH_DTYPES[requested]
        if device == "cpu" and dtype == torch.bfloat16 and not cpu.native_bf16:
            log.warning(
                "bfloat16 on a CPU without native bf16 (%s): stored in bf16, computed without oneDNN's "
                "bf16 kernels; --dtype float32 is faster here", cpu.describe()
            )
        return dtype
    if device == "cpu" and quantized_weights:
        log.info("dtype auto -> float32: the weights stay quantized, and their kernel multiplies in float32 (answers as "
                 "the float32 reference)")
        return torch.float32
    if device == "cpu":
        dtype = torch.bfloat16 if cpu.native_bf16 else torch.float32
        why = "native bf16 matmuls" if cpu.native_bf16 else "no native bf16, so float32 is the fastest exact choice"
        log.info("dtype auto -> %s: this CPU has %s (%s)", str(dtype).removeprefix("torch."), cpu.describe(), why)
        return dtype
    named = TORCH_DTYPES.get(str(checkpoint_dtype).removeprefix("torch."))
    return named if named in (torch.bfloat16, torch.float16) else torch.bfloat16


def serving_dtype(requested: str, checkpoint: Checkpoint, device: str, quantization: str) -> torch.dtype:
    """resolve_dtype for this checkpoint as load_model will load it (quantized or not)."""
    quantized_weights = bool(quantized_load(checkpoint, quantization, device))
    return resolve_dtype(requested, parse_arch(checkpoint.config()).torch_dtype, device, quantized_weights)


def load_model(
    checkpoint: Checkpoint | str | Path,
    dtype: str = "auto",
    device: str = "cpu",
    max_model_len: int | None = None,
    group: TensorParallelGroup = SINGLE,
    quantization: str = "auto",
) -> LoadedModel:
    """The whole model, or with a tensor-parallel `group` this rank's shard of it (read
    from the checkpoint alone: other ranks' slices are never loaded)."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {quantization!r}")
    if not isinstance(checkpoint, Checkpoint):
        checkpoint = open_checkpoint(checkpoint)
    if device == "cpu":  # before fuse(): Linear packs its weight for the kernels of this build
        cpu_kernels.configure(compiler_isa_flags(detect()))
    config = checkpoint.config()
    arch = parse_arch(config)
    plan = quantized_load(checkpoint, quantization, device)
    torch_dtype = resolve_dtype(dtype, arch.torch_dtype, device, quantized_weights=bool(plan))
    max_len = resolve_max_model_len(max_model_len, arch)

    with torch.device("meta"):
        model = CausalLM(arch, max_positions=max_len, group=group)
    _materialise(model, device, torch_dtype)
    model.tie_weights()
    for module in model.modules():  # the fp32 rotary table is derived, not loaded
        if isinstance(module, RotaryEmbedding):
            module.rebuild()
    _load_weights(model, checkpoint, arch, plan)
    model.tie_weights()  # a kept table is the head's too
    model.fuse()
    model.eval().requires_grad_(False)
    if device == "cpu":  # built (or found cached) by now, not on the first request
        log.info("CPU ops: %s", cpu_kernels.describe())
    return LoadedModel(model, arch, torch_dtype, max_len, checkpoint.eos_token_ids())


@dataclass(frozen=True)
class QuantizedLoad:
    """What the loader keeps quantized: the stored formats it hands over as they are (GGUF
    blocks the kernels read), and the format it quantizes every other linear and embedding
    weight to (None: it dequantizes them)."""

    keep: frozenset[str] = field(default_factory=frozenset)
    quantize_to: str | None = None

    def __bool__(self) -> bool:
        return bool(self.keep) or self.quantize_to is not None


def quantized_load(checkpoint: Checkpoint, quantization: str, device: str) -> QuantizedLoad:
    """Quantized weights are read by the C kernels: on CPU, with the kernels built (the torch
    fallback dequantizes a whole weight per call). A tensor-parallel rank keeps its shard's
    blocks where the shard is cut on block boundaries (rows, or columns in whole blocks of
    32: `tensors(select, keep)`), else reads that tensor dequantized. `auto` keeps what it can
    and asks for nothing; q8_0 and q4_0 are asked for, and fail in one line where they
    cannot be had."""
    if quantization == "none":
        return QuantizedLoad()
    usable = device == "cpu" and cpu_kernels.available()
    stored = checkpoint.quantized_formats() & frozenset(quantized.FORMATS)
    if quantization == "auto":
        return QuantizedLoad(stored) if usable and stored else QuantizedLoad()
    if not usable:
        raise ModelLoadError(f"--quantization {quantization} needs the CPU kernels (GPUs, and CPUs without a C compiler, "
                             "read dequantized weights)")
    return QuantizedLoad(stored, quantization.upper())


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


def _load_weights(model: CausalLM, checkpoint: Checkpoint, arch: ModelArch, plan: QuantizedLoad) -> None:
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    unexpected: list[str] = []
    shard = model.shard
    desc = f"Loading {checkpoint.path.name}" + (f" (rank {shard.rank} of {shard.size})" if shard.size > 1 else "")
    with tqdm(total=checkpoint.num_tensors(), desc=desc, unit="tensor", disable=None) as bar:
        for name, tensor in checkpoint.tensors(lambda n: tensor_slice(n, arch, shard), plan.keep):
            bar.update()
            if name.endswith(_IGNORED_SUFFIXES) or (name == "lm_head.weight" and arch.tie_word_embeddings):
                continue
            param = params.get(name)
            if param is None:
                unexpected.append(name)
                continue
            if plan.quantize_to and not isinstance(tensor, QuantizedTensor) and _quantizable(model, name, tensor):
                tensor = _quantized(tensor, plan.quantize_to)
            if isinstance(tensor, QuantizedTensor):
                _load_quantized(model, name, tensor)
                loaded.add(name)
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


def _quantizable(model: CausalLM, name: str, tensor: torch.Tensor) -> bool:
    """A linear's or an embedding's weight, its rows whole blocks of 32."""
    owner = model.get_submodule(name.rpartition(".")[0])
    return name.endswith(".weight") and isinstance(owner, HoldsQuantizedWeight) and tensor.dim() == 2 and tensor.shape[1] % 32 == 0


def _quantized(tensor: torch.Tensor, fmt: str) -> QuantizedTensor:
    """`tensor` in GGUF's `fmt` blocks, by gguf's own quantizer (llama.cpp's rounding)."""
    rows = gguf_quantize(tensor.float().numpy(), GGMLQuantizationType[fmt])
    return QuantizedTensor(fmt, torch.from_numpy(rows), (tensor.shape[0], tensor.shape[1]))


def _load_quantized(model: CausalLM, name: str, tensor: QuantizedTensor) -> None:
    """A linear's or the embedding's weight, kept in its blocks (packed for the kernels)."""
    module = model.get_submodule(name.removesuffix(".weight"))
    if not isinstance(module, HoldsQuantizedWeight):
        raise ModelLoadError(f"{name}: stored {tensor.fmt}, and {type(module).__name__} cannot read it quantized")
    # the last vocab-parallel shard may have fewer rows than the others: zero blocks pad it
    rows = module.dense_shape()[0]
    try:
        module.load_quantized(quantized.pack(tensor.rows, tensor.fmt, tensor.shape[1], rows if name in VOCAB_TENSORS else None))
    except ValueError as e:
        raise ModelLoadError(f"{name}: {e}") from None
