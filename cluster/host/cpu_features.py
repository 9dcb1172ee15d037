"""What this CPU can do, detected once, and the switches that force a capability off.

Four capabilities decide pdserve's CPU paths:

    avx2         the floor: float32 everywhere, bfloat16 only emulated
    avx512       AVX-512 F/BW/VL/DQ: oneDNN can pre-pack bf16 weights, but converts them
    avx512_bf16  native bf16 dot products (AMD Zen 4+, Intel Cooper Lake+)
    amx          Intel AMX tiles (Sapphire Rapids+): native bf16 matmuls

`PDSERVE_CPU_DISABLE=avx512_bf16,amx` (comma-separated) forces capabilities off, so the
fallback paths run on any machine. A capability implies the ones above it in the list,
so disabling one disables everything that needs it (disabling avx512 also disables
avx512_bf16 and amx). The switch reaches torch too: `apply_isa_limits()`, called by
every entry point before torch is imported, caps oneDNN (`ONEDNN_MAX_CPU_ISA`) and
ATen's vector kernels (`ATEN_CPU_CAPABILITY`) at what is left, and processes started
later (Ray workers) inherit it. This module never imports torch.
"""

from __future__ import annotations

import functools
import logging
import os
import platform
import sys
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

DISABLE_ENV = "PDSERVE_CPU_DISABLE"
CAPABILITIES = ("avx2", "avx512", "avx512_bf16", "amx")
# What each capability needs first (a capability is off when any of these is off).
_REQUIRES = {"avx2": (), "avx512": ("avx2",), "avx512_bf16": ("avx512",), "amx": ("avx512",)}
# /proc/cpuinfo flags that make each capability.
_FLAGS = {
    "avx2": ("avx2", "fma"),
    "avx512": ("avx512f", "avx512bw", "avx512vl", "avx512dq"),
    "avx512_bf16": ("avx512_bf16",),
    "amx": ("amx_bf16", "amx_tile"),
}


class CpuCapabilityError(ValueError):
    pass


@dataclass(frozen=True)
class CpuFeatures:
    avx2: bool
    avx512: bool
    avx512_bf16: bool
    amx: bool
    disabled: frozenset[str] = frozenset()  # forced off by PDSERVE_CPU_DISABLE

    @property
    def native_bf16(self) -> bool:
        """bf16 matmuls in hardware: bf16 is then the fastest safe serving dtype."""
        return self.avx512_bf16 or self.amx

    @property
    def kind(self) -> str:
        """The best capability present, for logs and the README's table."""
        for name in reversed(CAPABILITIES):
            if getattr(self, name):
                return name
        return "baseline"

    def describe(self) -> str:
        have = [c for c in CAPABILITIES if getattr(self, c)] or ["no AVX2"]
        off = f" ({', '.join(sorted(self.disabled))} forced off by {DISABLE_ENV})" if self.disabled else ""
        return "+".join(have) + off


def parse_disabled(value: str | None) -> frozenset[str]:
    names = frozenset(x.strip().lower() for x in (value or "").split(",") if x.strip())
    unknown = names - set(CAPABILITIES)
    if unknown:
        raise CpuCapabilityError(f"{DISABLE_ENV}: unknown capabilities {sorted(unknown)}; known: {', '.join(CAPABILITIES)}")
    return names


def features_from_flags(flags: set[str], disabled: frozenset[str] = frozenset()) -> CpuFeatures:
    have: dict[str, bool] = {}
    for name in CAPABILITIES:  # in order: requirements are decided first
        have[name] = (
            name not in disabled and all(f in flags for f in _FLAGS[name]) and all(have[r] for r in _REQUIRES[name])
        )
    return CpuFeatures(**have, disabled=disabled)


def _cpuinfo_field(name: str, cpuinfo: Path) -> str | None:
    """The first processor's `name` field (Linux); None where there is no cpuinfo."""
    try:
        for line in cpuinfo.read_text().splitlines():
            if line.split(":", 1)[0].strip() == name:
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> set[str]:
    """The first processor's feature flags (Linux); empty where there is no cpuinfo."""
    return set((_cpuinfo_field("flags", cpuinfo) or "").split())


def cpu_summary(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """Model name and capabilities, as benchmark results record the machine."""
    return f"{_cpuinfo_field('model name', cpuinfo) or platform.machine()}, {os.cpu_count()} cores: {detect().describe()}"


@functools.cache
def detect() -> CpuFeatures:
    """This machine's capabilities, minus those forced off."""
    return features_from_flags(cpu_flags(), parse_disabled(os.environ.get(DISABLE_ENV)))


def isa_limits(features: CpuFeatures) -> dict[str, str]:
    """Environment that keeps oneDNN and ATen within `features` (empty: no limit needed)."""
    if not features.disabled:
        return {}
    if features.amx:
        onednn, aten = "AVX512_CORE_AMX", "avx512"
    elif features.avx512_bf16:
        onednn, aten = "AVX512_CORE_BF16", "avx512"
    elif features.avx512:
        onednn, aten = "AVX512_CORE", "avx512"
    elif features.avx2:
        onednn, aten = "AVX2", "avx2"
    else:
        onednn, aten = "SSE41", "default"
    return {"ONEDNN_MAX_CPU_ISA": onednn, "ATEN_CPU_CAPABILITY": aten}


# The GCC/Clang switch that keeps generated code off each capability, and everything that
# needs it (-mno-avx512f drops every AVX-512 extension; the C kernels' AMX code also needs
# AVX512-BF16, so it goes with either).
_COMPILER_SWITCHES = {"avx2": "-mno-avx", "avx512": "-mno-avx512f", "avx512_bf16": "-mno-avx512bf16", "amx": "-mno-amx-tile"}


def compiler_isa_flags(features: CpuFeatures) -> list[str]:
    """Switches that keep `-march=native` C code (kernels/cpu.py) within `features`
    (empty: no limit needed). The first capability off is enough: the rest need it."""
    if not features.disabled:
        return []
    off = [name for name in CAPABILITIES if not getattr(features, name) and _COMPILER_SWITCHES[name]]
    return [_COMPILER_SWITCHES[off[0]]] if off else []


def apply_isa_limits() -> None:
    """Cap torch at the detected (possibly reduced) capabilities. Must run before torch
    is imported: both libraries read these variables once, when they first need them."""
    limits = isa_limits(detect())
    if limits and "torch" in sys.modules:
        log.warning("%s applies to pdserve's choices only: torch was imported first and keeps the CPU's own kernels", DISABLE_ENV)
    for key, value in limits.items():
        os.environ.setdefault(key, value)
