"""CPU capability detection and the choices that follow from it, for every CPU kind,
whatever CPU runs the tests (capabilities are given, not read from this machine)."""

import pytest
import torch

from cluster.host import cpu_features
from cluster.host.cpu_features import CpuCapabilityError, compiler_isa_flags, features_from_flags, isa_limits, parse_disabled
from cluster.model import linear, loader

AVX2 = {"avx", "avx2", "fma"}
AVX512 = AVX2 | {"avx512f", "avx512bw", "avx512vl", "avx512dq"}
ZEN4 = AVX512 | {"avx512_bf16"}  # AMD EPYC Genoa: AVX-512-BF16, no AMX
SAPPHIRE_RAPIDS = ZEN4 | {"amx_bf16", "amx_tile", "amx_int8"}


@pytest.mark.parametrize(
    "flags, kind, native_bf16",
    [(set(), "baseline", False), (AVX2, "avx2", False), (AVX512, "avx512", False), (ZEN4, "avx512_bf16", True),
     (SAPPHIRE_RAPIDS, "amx", True)],
)
def test_each_cpu_kind(flags, kind, native_bf16):
    f = features_from_flags(flags)
    assert f.kind == kind and f.native_bf16 == native_bf16
    assert isa_limits(f) == {}  # nothing forced off: torch keeps the CPU's own kernels


def test_disabling_a_capability_disables_what_needs_it():
    f = features_from_flags(SAPPHIRE_RAPIDS, parse_disabled("avx512"))
    assert (f.avx2, f.avx512, f.avx512_bf16, f.amx) == (True, False, False, False)
    assert isa_limits(f) == {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}
    f = features_from_flags(SAPPHIRE_RAPIDS, parse_disabled(" AMX , avx512_bf16"))
    assert f.kind == "avx512" and not f.native_bf16
    assert isa_limits(f)["ONEDNN_MAX_CPU_ISA"] == "AVX512_CORE"
    assert features_from_flags(SAPPHIRE_RAPIDS, parse_disabled("amx")).kind == "avx512_bf16"
    assert "forced off" in f.describe()


def test_compiler_switches_follow_what_is_forced_off():
    def switches(disabled: str, flags=SAPPHIRE_RAPIDS) -> list[str]:
        return compiler_isa_flags(features_from_flags(flags, parse_disabled(disabled)))

    assert switches("") == [] and switches("", AVX2) == []  # -march=native alone is right
    assert switches("avx512") == ["-mno-avx512f"]  # which drops every AVX-512 extension
    assert switches("avx512_bf16") == ["-mno-avx512bf16"]
    assert switches("amx") == ["-mno-amx-tile"]  # the C linear's AMX tiles
    assert switches("avx2") == ["-mno-avx"]
    assert switches("amx", AVX2) == ["-mno-avx512f"]  # harmless where AVX-512 is absent anyway


def test_unknown_capability_names_the_known_ones():
    with pytest.raises(CpuCapabilityError, match="known: avx2, avx512, avx512_bf16, amx"):
        parse_disabled("avx512,sse9")


def test_flags_come_from_cpuinfo(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu avx2 fma avx512f avx512bw avx512vl avx512dq avx512_bf16\n\n")
    assert features_from_flags(cpu_features.cpu_flags(info)).kind == "avx512_bf16"
    assert cpu_features.cpu_flags(tmp_path / "missing") == set()


@pytest.fixture
def cpu(monkeypatch):
    """Pretend to be a given CPU kind for pdserve's choices."""

    def use(flags, disabled=""):
        features = features_from_flags(flags, parse_disabled(disabled))
        for module in (loader, linear):
            monkeypatch.setattr(module, "detect", lambda: features)
        return features

    return use


@pytest.mark.parametrize("flags, expected", [(AVX2, torch.float32), (AVX512, torch.float32), (ZEN4, torch.bfloat16),
                                             (SAPPHIRE_RAPIDS, torch.bfloat16)])
def test_auto_dtype_by_cpu_kind(cpu, flags, expected):
    cpu(flags)
    assert loader.resolve_dtype("auto", "float32", "cpu") == expected
    assert loader.resolve_dtype("auto", "float16", "cpu") == expected  # a checkpoint's dtype does not decide on CPU
    assert loader.resolve_dtype("float32", None, "cpu") == torch.float32  # an explicit dtype always wins
    assert loader.resolve_dtype("bfloat16", None, "cpu") == torch.bfloat16


def test_auto_dtype_on_gpu_follows_the_checkpoint(cpu):
    cpu(AVX2)
    assert loader.resolve_dtype("auto", "float16", "cuda") == torch.float16
    assert loader.resolve_dtype("auto", "float32", "cuda") == torch.bfloat16


def test_bf16_without_native_support_warns_with_the_dtype_to_use(cpu, caplog):
    cpu(ZEN4, disabled="avx512_bf16")
    with caplog.at_level("WARNING"):
        assert loader.resolve_dtype("bfloat16", None, "cpu") == torch.bfloat16
    assert "--dtype float32 is faster here" in caplog.text


def test_bf16_weights_are_prepacked_only_with_native_bf16_and_fp32_ones_everywhere(cpu):
    weight = torch.randn(8, 4).bfloat16()
    cpu(AVX2)
    assert not linear.can_pack(weight)
    assert linear.can_pack(weight.float())  # oneDNN's fp32 kernels run on AVX2
    cpu(AVX512)  # oneDNN could pack here, but only emulates bf16
    assert not linear.can_pack(weight)
    cpu(ZEN4)
    assert linear.can_pack(weight) == torch.ops.mkldnn._is_mkldnn_bf16_supported()
    assert linear.can_pack(weight.float())
    assert not linear.can_pack(weight.half())


def test_the_c_kernel_row_limit_follows_the_cpu(cpu):
    """Every bf16 row count where bf16 is not native; more bf16 rows where it is (linear.py's
    tables); fp32 the same everywhere."""
    rows = linear.c_kernel_max_rows
    for flags in (SAPPHIRE_RAPIDS, ZEN4, AVX512, AVX2):
        cpu(flags)
        assert rows(torch.float32) == linear.C_KERNEL_MAX_ROWS and rows(torch.float16) == 0
    for flags in (ZEN4, SAPPHIRE_RAPIDS):  # AVX512-BF16 dot products, or AMX tiles, keep up with oneDNN
        cpu(flags)
        assert rows(torch.bfloat16) == linear.WIDE_KERNEL_MAX_ROWS
    cpu(SAPPHIRE_RAPIDS, disabled="amx")  # still AVX512-BF16
    assert rows(torch.bfloat16) == linear.WIDE_KERNEL_MAX_ROWS
    cpu(ZEN4, disabled="avx512_bf16")  # AVX-512 without native bf16: oneDNN cannot pack bf16, F.linear emulates it
    assert rows(torch.bfloat16) > 100_000
    cpu(AVX512)
    assert rows(torch.bfloat16) > 100_000


def test_weights_are_packed_for_the_kernels_the_capabilities_allow(cpu, tiny_llama):
    """A CPU with AVX-512 forced off loads its model with the AVX2 build of the C kernels,
    and packs each weight for that build (not for the native one, then again)."""
    from kernels import cpu as cpu_kernels  # noqa: PLC0415

    cpu(ZEN4, disabled="avx512")
    try:
        model = loader.load_model(tiny_llama, dtype="float32").model
        assert cpu_kernels.describe().endswith("(capped: -mno-avx512f)")
        packed = [m.kernel_weight for m in model.modules() if isinstance(m, linear.Linear)]
        assert packed and all(w.fits_library() for w in packed)
    finally:
        cpu_kernels.configure([])


@pytest.mark.parametrize("rows", [1, 3, 300])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_packed_path_computes_what_f_linear_does(rows, dtype):
    layer = linear.Linear(64, 48, bias=True).to(dtype)
    x = torch.randn(rows, 64, dtype=dtype)
    expected = torch.nn.functional.linear(x, layer.weight, layer.bias)
    layer.pack_for_cpu()
    if layer.packed_weight is None:
        pytest.skip(f"this CPU does not pack {dtype} weights")
    torch.testing.assert_close(layer(x), expected, **({} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}))
