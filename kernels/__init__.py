"""Hot ops of the engine. Each op has a Triton kernel, used when its input is on CUDA, a C
kernel built for this CPU (kernels/cpu.py), used on CPU where it can run, and a pure-torch
reference: the numerical spec, and the CPU path where the C kernels cannot run."""

from kernels.kv_store import store_kv
from kernels.paged_attention import DecodeGather, decode_gather, paged_attention_decode
from kernels.rms_norm import rms_norm
from kernels.rotary import apply_rotary
from kernels.silu_gate import silu_and_mul

__all__ = ["DecodeGather", "apply_rotary", "decode_gather", "paged_attention_decode", "rms_norm", "silu_and_mul", "store_kv"]
