"""Every CPU path runs on whichever CPU runs the suite: PDSERVE_CPU_DISABLE forces
capabilities off in a real `pdserve` process (torch's oneDNN and ATen included), and the
built-in model must still answer correctly in bfloat16 and in the dtype `auto` picks."""

import json
import os
import subprocess
import sys

import pytest

from cluster.cpu_features import detect

PDSERVE = [sys.executable, "-m", "cluster.cli"]
QUESTION = "What is the capital of France?"


def run(*args, disable: str | None = None, c_kernels: bool = True, **kw):
    env = {k: v for k, v in os.environ.items() if k not in ("ONEDNN_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY", "PDSERVE_CPU_DISABLE")}
    if disable:
        env["PDSERVE_CPU_DISABLE"] = disable
    if not c_kernels:
        env["PDSERVE_CPU_KERNELS"] = "0"
    return subprocess.run([*args], capture_output=True, text=True, timeout=300, env=env, **kw)


def torch_view(disable: str) -> dict:
    probe = (
        "import json, torch; from cluster.cpu_features import apply_isa_limits, detect; "
        "print(json.dumps({'aten': torch.backends.cpu.get_cpu_capability(), "
        "'onednn_bf16': torch.ops.mkldnn._is_mkldnn_bf16_supported(), 'kind': detect().kind}))"
    )
    # apply_isa_limits must run before torch loads: the probe imports it first.
    r = run(sys.executable, "-c", "from cluster.cpu_features import apply_isa_limits; apply_isa_limits(); " + probe, disable=disable)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


@pytest.mark.skipif(not detect().avx2, reason="the machine has no AVX2")
def test_forcing_avx512_off_reaches_torch():
    view = torch_view("avx512")
    assert view == {"aten": "AVX2", "onednn_bf16": False, "kind": "avx2"}  # as on an AVX2-only EPYC


@pytest.mark.parametrize("disable", ["avx512", "avx512_bf16,amx", "amx", None])
def test_builtin_model_answers_in_bfloat16_on_every_cpu_path(disable):
    if disable is None and not detect().native_bf16:
        pytest.skip("this CPU has no native bf16: the forced runs cover what it can do")
    r = run(*PDSERVE, "generate", "--chat", QUESTION, "--max-tokens", "12", "--dtype", "bfloat16", disable=disable)
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout
    native = detect().native_bf16 and (disable is None or disable == "amx")
    assert ("computed without oneDNN's bf16 kernels" in r.stderr) == (not native), r.stderr


def test_auto_dtype_on_an_avx2_cpu_is_float32_and_says_why():
    r = run(*PDSERVE, "generate", "--chat", QUESTION, "--max-tokens", "12", disable="avx512")
    assert r.returncode == 0, r.stderr
    assert "dtype auto -> float32" in r.stderr and "forced off" in r.stderr
    assert "Paris" in r.stdout


@pytest.mark.parametrize("disable", [None, "avx512"])
def test_c_kernels_give_the_torch_reference_tokens_in_float32(disable):
    """The whole model on the C kernels (native, and built for AVX2) vs torch's reference
    ops: the same greedy tokens, 48 of them, in float32."""
    args = [*PDSERVE, "generate", "--chat", "Name three rivers of Europe.", "--max-tokens", "48", "--dtype", "float32"]
    with_c, reference = run(*args, disable=disable), run(*args, disable=disable, c_kernels=False)
    assert with_c.returncode == 0 and reference.returncode == 0, with_c.stderr + reference.stderr
    assert "CPU ops: C kernels built for this CPU" in with_c.stderr
    assert "CPU ops: torch reference ops (PDSERVE_CPU_KERNELS=0)" in reference.stderr
    assert with_c.stdout == reference.stdout and len(with_c.stdout.split()) > 10
