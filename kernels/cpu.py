"""The C kernels of kernels/csrc/: built on this machine, for this CPU, on first use.

Each op's CPU path is `kernel if cpu.usable(...) else reference`; the reference stays the
numerical spec (tests compare the two) and the path where the kernels cannot run:
  - no C compiler, or the build fails (logged once, never an error);
  - a dtype other than float32 / bfloat16;
  - `PDSERVE_CPU_KERNELS=0` (the switch that forces the reference path anywhere).

Build: `cc -O3 -march=native`, plus the `-mno-*` switches that `configure()` is given
(cluster/host/cpu_features.py derives them from PDSERVE_CPU_DISABLE, and the model loader
passes them), so the AVX2 code of an AVX-512 machine can be built and tested there. The
library is cached under ~/.cache/pdserve/kernels by a hash of the sources (every file of
csrc/), the flags, the compiler binary and this CPU's identity (/proc/cpuinfo, what
`-march=native` reads): a different CPU never loads a library built for another, and a
cached library costs no compiler run. Plain C without torch's headers: a build takes about
a second.

Sources (csrc/): cpu_kernels.c is the one file compiled, and it includes a file per op, so
the kernels stay one translation unit (GCC inlines and specializes across ops as within one
file): linear.c, activation.c, norm.c, rotary.c, kv_store.c, attend.c, attention_run.c,
paged_attention.c, step.c and capabilities.c, with what they share in cpu_kernels.h and
attention.h. cpu_kernels.c's comment says what each file holds.

Calls go through ctypes with raw pointers (a few microseconds each); torch's OpenMP
runtime is already loaded when the library is, so both share one thread pool.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SWITCH_ENV = "PDSERVE_CPU_KERNELS"
SOURCE = Path(__file__).parent / "csrc" / "cpu_kernels.c"  # the file compiled: it includes the others
CACHE_DIR = Path(os.environ.get("PDSERVE_CACHE_DIR", Path.home() / ".cache" / "pdserve")) / "kernels"
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}

_isa_flags: tuple[str, ...] = ()  # set by configure()

_p, _i64, _i32, _f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
_SIGNATURES = {  # name: (argument types, result type)
    "pd_packed_linear_numel": ([_i64, _i64, _i32], _i64),
    "pd_packed_linear_layout": ([_i32], _i32),
    "pd_quantized_record_bytes": ([_i32], _i64),
    "pd_amx_tiles": ([], _i32),
    "pd_bf16_products": ([], _i32),
    "pd_compact_weights": ([], _i32),
    "pd_pack_linear_weight": ([_p, _p, _i64, _i64, _i32], None),
    "pd_linear": ([_p, _i32, _p, _f32, _p, _p, _p, _p, _i64, _i64, _i64, _i32, _i32, _i32], None),
    "pd_rms_norm": ([_p, _p, _i64, _p, _i64, _i64, _f32, _i32, _i32, _i32, _i32], None),
    "pd_silu_and_mul": ([_p, _p, _i64, _i64, _i64, _i32, _i32], None),
    "pd_rotary": ([_p, _p, _i64, _i64, _i64, _i64, _p, _p, _i32, _i32], None),
    "pd_store_kv": ([_p, _i64, _p, _i64, _p, _p, _p, _i64, _i64, _i32, _i32], None),
    "pd_paged_attention_decode": (
        [_p, _p, _i64, _i32, _p, _p, _i32, _p, _i64, _p, _i64, _i64, _i64, _i64, _i64, _f32, _i32], None),
    "pd_rotary_store_attend": (
        [_p, _p, _i64, _p, _i64, _p, _i64, _i32, _p, _p, _p, _p, _p, _i32, _p, _i64, _p, _i64, _i64, _i64, _i64, _i64,
         _f32, _i32], None),
    "pd_step_layers": (
        [_p, _i64, _p, _i64, _i64, _i64, _i64, _i64, _i64, _f32, _f32, _i32, _i32, _p, _p, _p, _i32, _p, _i64, _p, _i64,
         _i32],
        None),
}
LINEAR_PLAIN, LINEAR_RMS_NORM, LINEAR_SILU_MUL = 0, 1, 2  # pd_linear's prologues


def configure(isa_flags: list[str] | tuple[str, ...]) -> None:
    """Keep the kernels off the ISA extensions these `-mno-*` switches name (empty: all
    of this CPU's). A change takes effect at the next op: the library is loaded again."""
    global _isa_flags
    if tuple(isa_flags) != _isa_flags:
        _isa_flags = tuple(isa_flags)
        reload()


def isa_flags() -> tuple[str, ...]:
    """The `-mno-*` switches the kernels are built with (configure's)."""
    return _isa_flags


def compile_flags() -> list[str]:
    # GCC's tuning for Intel's AVX-512 CPUs vectorizes loops 256 bits wide unless told
    # otherwise (the SiLU of a 4096-token prefill: 4.2 -> 3.1 ms with 512); without
    # AVX-512 (or with it forced off) the widest the ISA has is used, as before.
    return ["-O3", "-march=native", "-mprefer-vector-width=512", *_isa_flags, "-fopenmp", "-fno-math-errno",
            "-fno-trapping-math", "-shared", "-fPIC"]


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def _this_cpu() -> str:
    """What `-march=native` reads: the CPU's vendor, family, model and feature flags."""
    try:
        first = Path("/proc/cpuinfo").read_text().split("\n\n", 1)[0]
    except OSError:
        return platform.processor() or platform.machine()
    fields = ("vendor_id", "cpu family", "model", "model name", "flags")
    return "\n".join(line for line in first.splitlines() if line.split(":", 1)[0].strip() in fields)


def _sources() -> list[Path]:
    """Every file of SOURCE's directory: what a build may read (SOURCE and what it includes)."""
    return sorted(SOURCE.parent.glob("*.[ch]"))


def _library_path(cc: str, flags: list[str]) -> Path:
    binary = Path(shutil.which(cc) or cc).resolve()
    stat = binary.stat()
    compiler = f"{binary} {stat.st_size} {stat.st_mtime_ns}"  # a compiler upgrade rebuilds
    sources = [f"{path.name}\n{path.read_text()}" for path in _sources()]  # an edit to any of them rebuilds
    key = "\n".join([*sources, " ".join(flags), compiler, _this_cpu()])
    return CACHE_DIR / f"cpu_kernels-{hashlib.sha256(key.encode()).hexdigest()[:16]}.so"


def build() -> Path:
    """Compile the library (or find it cached); raises on failure."""
    cc = _compiler()
    if cc is None:
        raise RuntimeError("no C compiler (cc/gcc) on PATH")
    flags = compile_flags()
    path = _library_path(cc, flags)
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename: concurrent builders (several workers) never
    # load a half-written file.
    with tempfile.NamedTemporaryFile(dir=path.parent, suffix=".so", delete=False) as tmp:
        pass
    result = subprocess.run([cc, *flags, str(SOURCE), "-o", tmp.name, "-lm"], capture_output=True, text=True)
    if result.returncode != 0:
        os.unlink(tmp.name)
        raise RuntimeError(f"{cc} failed: {result.stderr.strip()[-2000:]}")
    os.replace(tmp.name, path)
    return path


def enabled() -> bool:
    return os.environ.get(SWITCH_ENV, "1") != "0"


@functools.cache
def _load() -> tuple[ctypes.CDLL | None, str]:
    """(the loaded kernels, "") or (None, why they cannot run); the failure is logged once."""
    if not enabled():
        return None, f"{SWITCH_ENV}=0"
    try:
        lib = ctypes.CDLL(str(build()))
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        log.warning("CPU kernels unavailable, using torch's ops instead: %s", e)
        return None, str(e)
    for name, (argtypes, restype) in _SIGNATURES.items():
        getattr(lib, name).argtypes = argtypes
        getattr(lib, name).restype = restype
    return lib, ""


def library() -> ctypes.CDLL | None:
    """The loaded kernels, or None where they cannot run."""
    return _load()[0]


def reload() -> None:
    """Load the library again at the next op (after PDSERVE_CPU_KERNELS changed)."""
    _load.cache_clear()
    packed_layout.cache_clear()
    amx_tiles.cache_clear()
    bf16_products.cache_clear()
    compact_weights.cache_clear()


@functools.cache
def bf16_products() -> bool:
    """The loaded kernels multiply bf16 in hardware (AVX512-BF16 dot products, AMX tiles or
    not): a prompt chunk's attention then runs faster here than in torch's SDPA."""
    lib = library()
    return lib is not None and bool(lib.pd_bf16_products())


@functools.cache
def amx_tiles() -> bool:
    """The loaded kernels multiply bf16 in AMX tiles: built with AMX, and Linux granted them
    the tile state."""
    lib = library()
    return lib is not None and bool(lib.pd_amx_tiles())


@functools.cache
def compact_weights() -> bool:
    """The loaded kernels multiply fp32 rows by bf16 weights (where bf16 packs as fp32 does:
    no bf16 products), so an fp32 model's weights that bf16 holds exactly can be packed at
    half the bytes (pack_linear_weight)."""
    lib = library()
    return lib is not None and bool(lib.pd_compact_weights())


def bf16_holds(weight: torch.Tensor) -> bool:
    """Every element of this fp32 tensor is a bf16 value: its low 16 bits are zero (a bf16
    checkpoint served in fp32)."""
    return weight.dtype == torch.float32 and not (weight.view(torch.int32) & 0xFFFF).any()


def available() -> bool:
    return library() is not None


def describe() -> str:
    """Which CPU path the hot ops take, for the log line at model load."""
    lib, unavailable_because = _load()
    if lib is None:
        return f"torch reference ops ({unavailable_because})"
    return "C kernels built for this CPU" + (f" (capped: {' '.join(_isa_flags)})" if _isa_flags else "")


def usable(*tensors: torch.Tensor) -> bool:
    """The kernels can take these tensors: on CPU, float32/bfloat16, last dim contiguous.
    (Asked several times per layer and step: a plain loop over the cheapest checks.)"""
    if library() is None:
        return False
    for t in tensors:
        if not (t.is_cpu and t.dtype in DTYPE_CODES and (t.is_contiguous() or t.stride(-1) == 1)):
            return False
    return True


def _threads() -> int:
    return torch.get_num_threads()


@dataclass(frozen=True)
class PackedWeight:
    """A linear's weight in the layout `linear` reads (blocks of output columns; see
    pd_pack_linear_weight), packed once at model load."""

    data: torch.Tensor
    layout: int  # the loaded library's layout for this dtype: another build may differ
    out_features: int
    in_features: int

    def fits_library(self) -> bool:
        return packed_layout(self.data.dtype) == self.layout

    @property
    def code(self) -> int:
        """The weight dtype pd_linear is given."""
        return DTYPE_CODES[self.data.dtype]


@functools.cache
def packed_layout(dtype: torch.dtype) -> int:
    """The loaded library's packed-weight layout for `dtype` (asked once per load, not per call)."""
    return library().pd_packed_linear_layout(DTYPE_CODES[dtype])


def pack_linear_weight(weight: torch.Tensor, *, compact: bool = False) -> PackedWeight:
    """compact: the weight is fp32 and `bf16_holds` it; where the kernels take it
    (`compact_weights`), it is packed in bf16: a decode step streams half the bytes, and
    widening bf16 to fp32 is exact, so every product is the fp32 weight's own."""
    out_features, in_features = weight.shape
    if compact and compact_weights():
        weight = weight.to(torch.bfloat16)
    weight, code, lib = weight.contiguous(), DTYPE_CODES[weight.dtype], library()
    data = torch.empty(lib.pd_packed_linear_numel(in_features, out_features, code), dtype=weight.dtype)
    lib.pd_pack_linear_weight(weight.data_ptr(), data.data_ptr(), in_features, out_features, code)
    return PackedWeight(data, packed_layout(weight.dtype), out_features, in_features)


def linear(x: torch.Tensor, weight, bias: torch.Tensor | None, *, norm: tuple[torch.Tensor, float] | None = None,
           silu_mul: bool = False, residual: torch.Tensor | None = None) -> torch.Tensor:
    """y = prologue(x) @ w.T + bias (+ residual), the ops around the matmul fused into its
    reads and writes (see pd_linear):
      norm=(weight, eps): x is [B, K], rms_norm(x, weight, eps) is what gets multiplied;
      silu_mul: x is [B, 2K], silu(x[:, :K]) * x[:, K:] is;
      residual: [B, O], added to the linear's output, rounded as `residual + linear(...)`.
    Everything in x's dtype; x: [B, K] -> y: [B, O]. weight: a PackedWeight, or a
    kernels.quantized.QuantizedWeight (anything with data, code, in_ and out_features)."""
    x = x.contiguous()
    bias = bias.to(x.dtype).contiguous() if bias is not None else None
    prologue, norm_weight, eps = LINEAR_PLAIN, None, 0.0
    if norm is not None:
        prologue, (norm_weight, eps) = LINEAR_RMS_NORM, norm
        norm_weight = norm_weight.to(x.dtype).contiguous()
    elif silu_mul:
        prologue = LINEAR_SILU_MUL
    if residual is not None:
        residual = residual.to(x.dtype).contiguous()
    y = torch.empty(x.shape[0], weight.out_features, dtype=x.dtype)
    library().pd_linear(x.data_ptr(), prologue, _ptr(norm_weight), eps, weight.data.data_ptr(), _ptr(bias), _ptr(residual),
                        y.data_ptr(), x.shape[0], weight.in_features, weight.out_features, DTYPE_CODES[x.dtype],
                        weight.code, _threads())
    return y


def _ptr(t: torch.Tensor | None) -> int | None:
    return t.data_ptr() if t is not None else None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    hidden = x.shape[-1]
    rows = x.reshape(-1, hidden)  # a view when x's rows are evenly spaced (per-head norms on q/k)
    out = torch.empty(rows.shape, dtype=torch.promote_types(weight.dtype, x.dtype))
    library().pd_rms_norm(out.data_ptr(), rows.data_ptr(), rows.stride(0), weight.data_ptr(), rows.shape[0], hidden, eps,
                          DTYPE_CODES[x.dtype], DTYPE_CODES[weight.dtype], DTYPE_CODES[out.dtype], _threads())
    return out.view(x.shape)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    # x: [T, 2I] -> [T, I]
    rows = x.reshape(-1, x.shape[-1])
    inter = rows.shape[1] // 2
    out = torch.empty(rows.shape[0], inter, dtype=x.dtype)
    library().pd_silu_and_mul(out.data_ptr(), rows.data_ptr(), rows.stride(0), rows.shape[0], inter, DTYPE_CODES[x.dtype],
                              _threads())
    return out.view(*x.shape[:-1], inter)


def _rotate(x: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor) -> torch.Tensor:
    tokens, heads, head_dim = x.shape
    if x.stride(1) != head_dim:
        x = x.contiguous()
    out = torch.empty(x.shape, dtype=x.dtype)
    library().pd_rotary(out.data_ptr(), x.data_ptr(), x.stride(0), tokens, heads, head_dim, positions.data_ptr(),
                        cos_sin_cache.data_ptr(), DTYPE_CODES[x.dtype], _threads())
    return out


def rotary(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor):
    positions = positions.to(torch.int64).contiguous()
    cos_sin_cache = cos_sin_cache.contiguous()
    return _rotate(q, positions, cos_sin_cache), _rotate(k, positions, cos_sin_cache)


def store_kv(key, value, k_cache, v_cache, slot_mapping) -> None:
    tokens = key.shape[0]
    row = k_cache.shape[2] * k_cache.shape[3]
    key, value = (t if t.stride(1) == t.shape[2] else t.contiguous() for t in (key, value))
    slots = slot_mapping.to(torch.int64).contiguous()
    library().pd_store_kv(key.data_ptr(), key.stride(0), value.data_ptr(), value.stride(0), k_cache.data_ptr(),
                          v_cache.data_ptr(), slots.data_ptr(), tokens, row, DTYPE_CODES[key.dtype], DTYPE_CODES[k_cache.dtype])


def _tables_and_lens(block_tables: torch.Tensor, context_lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows' block tables and context lengths as the C side reads them (int32; a table's rows
    may share memory, as one prompt chunk's rows do: stride 0)."""
    tables = block_tables.to(torch.int32)
    return tables if tables.stride(-1) == 1 else tables.contiguous(), context_lens.to(torch.int32).contiguous()


def paged_attention_decode(q, k_cache, v_cache, block_tables, context_lens, scale: float) -> torch.Tensor:
    batch, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    if q.stride(1) != head_dim:
        q = q.contiguous()
    tables, lens = _tables_and_lens(block_tables, context_lens)
    out = torch.empty(q.shape, dtype=q.dtype)
    library().pd_paged_attention_decode(
        out.data_ptr(), q.data_ptr(), q.stride(0), DTYPE_CODES[q.dtype], k_cache.data_ptr(), v_cache.data_ptr(),
        DTYPE_CODES[k_cache.dtype], tables.data_ptr(), tables.stride(0), lens.data_ptr(), batch, num_q_heads,
        num_kv_heads, head_dim, block_size, scale, _threads(),
    )
    return out


def rotary_store_attend(q, k, v, positions, cos_sin_cache, slot_mapping, k_cache, v_cache, block_tables, context_lens,
                        scale: float) -> torch.Tensor:
    """A step's attention from its projections in one call: `rotary`, `store_kv` and
    `paged_attention_decode` in turn, the same numbers. q: [B, Hq, D]; k, v: [B, Hk, D] (each
    may be a view into one qkv row); the caches are written in place; -> [B, Hq, D]."""
    batch, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    q, k, v = (t if t.stride(1) == head_dim else t.contiguous() for t in (q, k, v))
    positions, slots = positions.to(torch.int64).contiguous(), slot_mapping.to(torch.int64).contiguous()
    tables, lens = _tables_and_lens(block_tables, context_lens)
    out = torch.empty(q.shape, dtype=q.dtype)
    library().pd_rotary_store_attend(
        out.data_ptr(), q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), DTYPE_CODES[q.dtype],
        positions.data_ptr(), cos_sin_cache.contiguous().data_ptr(), slots.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
        DTYPE_CODES[k_cache.dtype], tables.data_ptr(), tables.stride(0), lens.data_ptr(), batch, num_q_heads, num_kv_heads,
        head_dim, block_size, scale, _threads(),
    )
    return out


class StepLayer(ctypes.Structure):
    """One decoder layer's tensors for `step_layers` (pd_layer in csrc/step.c): packed linear
    weights (PackedWeight.data), norm weights in the model's dtype, the layer's KV cache;
    qkv_bias, q_norm and k_norm may be None."""

    _fields_ = [(name, ctypes.c_void_p) for name in (
        "input_norm", "qkv", "qkv_bias", "q_norm", "k_norm", "o_proj", "post_norm", "gate_up", "down", "k_cache", "v_cache")]


@dataclass(frozen=True)
class DecoderShape:
    hidden: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate: int
    eps: float  # every RMSNorm's
    scale: float  # attention's


def step_layers(h: torch.Tensor, layers: ctypes.Array, weight_code: int, shape: DecoderShape, positions,
                cos_sin_cache, slot_mapping, block_tables, context_lens, kv_dtype: torch.dtype,
                block_size: int) -> torch.Tensor:
    """Every decoder layer of a step in one call (pd_step_layers): h [B, hidden] goes through
    `layers` in turn and is updated in place; the layers' caches get the new K/V. Every packed
    weight in `layers` is of `weight_code` (PackedWeight.code: h's dtype, or bf16 for compact
    fp32 ones; or QuantizedWeight.code, one quantized format). Each row's
    attention metadata as `rotary_store_attend` takes it: a decode token, or a prompt chunk's
    token with its request's block table and the context up to itself."""
    positions, slots = positions.to(torch.int64).contiguous(), slot_mapping.to(torch.int64).contiguous()
    tables, lens = _tables_and_lens(block_tables, context_lens)
    library().pd_step_layers(
        h.data_ptr(), h.shape[0], layers, len(layers), shape.hidden, shape.num_heads, shape.num_kv_heads, shape.head_dim,
        shape.intermediate, shape.eps, shape.scale, DTYPE_CODES[h.dtype], weight_code,
        positions.data_ptr(), cos_sin_cache.data_ptr(), slots.data_ptr(), DTYPE_CODES[kv_dtype], tables.data_ptr(),
        tables.stride(0), lens.data_ptr(), block_size, _threads(),
    )
    return h
