"""The `pdserve` command line, run as a user would (subprocess, real checkpoint)."""

import json
import os
import shutil
import subprocess

import psutil

from cluster.engine.engine import Engine
from cluster.engine.sampling_params import SamplingParams
from tests.helpers import PDSERVE, fresh_imports, run_all


def run(*args):
    return subprocess.run([*PDSERVE, *args], capture_output=True, text=True, timeout=300)


def test_make_model_then_generate_json_matches_engine(tmp_path):
    out = tmp_path / "m"
    r = run("make-model", "--arch", "qwen3", "--size", "tiny", "--out", str(out))
    assert r.returncode == 0, r.stderr
    assert (out / "config.json").exists() and (out / "tokenizer.json").exists()
    r = run("generate", "--model", str(out), "--prompt", "Hello there", "--max-tokens", "8", "--ignore-eos", "--json", "--dtype", "float32")
    assert r.returncode == 0, r.stderr
    result = json.loads(r.stdout.strip().splitlines()[-1])
    assert set(result) == {"prompt_token_ids", "token_ids", "text", "finish_reason"}
    assert len(result["token_ids"]) == 8 and result["finish_reason"] == "length"

    engine = Engine.from_pretrained(str(out), dtype="float32")
    done = engine.generate(["Hello there"], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0]
    assert result["token_ids"] == done.token_ids and result["prompt_token_ids"] == done.prompt_token_ids


def test_parsing_a_command_line_imports_neither_torch_nor_ray():
    """`pdserve --help` and every subcommand's parser stay fast: each command's code, with
    torch and Ray, is imported only when it runs."""
    parse_all = (
        "from cluster.cli import build_parser\n"
        "p = build_parser()\n"
        "for argv in (['bench', 'compare', '--target-a', '1p1d', '--target-b', 'colocated'], ['bench', 'chaos'],"
        " ['bench', 'engine', '--model', 'm'], ['serve'], ['status'], ['make-model', '--out', 'x']):\n"
        "    p.parse_args(argv)"
    )
    assert fresh_imports(parse_all, ("torch", "ray", "matplotlib", "aiohttp"))[0] == []
    help_text = run("--help")
    assert help_text.returncode == 0 and "bench" in help_text.stdout


def test_status_and_an_early_error_import_no_torch():
    """`pdserve status` asks Ray alone (cluster/launch/status.py): torch would double its time.
    A command that fails before its code is imported (here a bad PDSERVE_CPU_DISABLE)
    reports it in one line without importing torch or Ray to name the error's type."""
    assert fresh_imports("import cluster.launch.status", ("torch", "triton"))[0] == []
    imported, r = fresh_imports("from cluster.cli import main; print(main(['status']))", ("torch", "ray"),
                                env={**os.environ, "PDSERVE_CPU_DISABLE": "no-such-capability"})
    assert imported == [] and r.stdout.splitlines()[0] == "2", r.stdout + r.stderr
    assert r.stderr.strip().splitlines() == [
        "pdserve status: error: PDSERVE_CPU_DISABLE: unknown capabilities ['no-such-capability']; "
        "known: avx2, avx512, avx512_bf16, amx"
    ]


def test_errors_are_one_line_not_tracebacks(tmp_path, tiny_llama):
    cases = [
        ("generate", "--model", str(tmp_path / "missing"), "--prompt", "x"),
        ("generate", "--model", str(tiny_llama), "--prompt", ""),
        ("generate", "--model", str(tiny_llama), "--prompt", "x", "--max-tokens", "-3"),
        ("generate", "--model", str(tiny_llama), "--prompt", "x", "--max-tokens", "100000"),
        ("serve", "--model", str(tiny_llama), "--http-port", "99999"),
        ("serve", "--model", str(tiny_llama), "--decode-replicas", "0"),
        # nothing listens on port 1: the bench cannot ask the server for its model
        ("bench", "serve", "--base-url", "http://127.0.0.1:1", "--tokenizer", str(tiny_llama), "--num-prompts", "1"),
        ("bench", "engine", "--model", str(tiny_llama), "--batch-sizes", "0"),
        ("bench", "chaos", "--kill", "decode:NODE@1s"),  # a node fault without --nodes
    ]
    for args, r in zip(cases, run_all([[*PDSERVE, *args] for args in cases])):
        assert r.returncode == 2, (args, r.stderr)
        assert "Traceback" not in r.stderr
        assert "error:" in r.stderr
        assert "redis-server" not in r.stderr, r.stderr  # `serve` refused before it started anything


def test_serve_refuses_what_its_replicas_could_not_load_before_starting_anything(tmp_path, tiny_llama):
    """One line and exit 2, before the private redis-server or Ray start (they print first)."""
    no_tokenizer = tmp_path / "no-tokenizer"
    shutil.copytree(tiny_llama, no_tokenizer, ignore=shutil.ignore_patterns("tokenizer*"))
    free_gib = psutil.virtual_memory().available / 2**30
    over = ("--kv-cache-gib", f"{2 * free_gib:.0f}")
    all_caches = "the KV caches of all replicas would take"
    cases = [
        ("does not exist", ("serve", "--model", str(tmp_path / "missing"))),
        ("tokenizer.json", ("serve", "--model", str(no_tokenizer))),
        (all_caches, ("serve", "--model", str(tiny_llama), *over)),
        # each replica's cache would fit alone; the two decode and one prefill replicas' would not
        (all_caches, ("serve", "--model", str(tiny_llama), "--decode-replicas", "2", "--kv-cache-gib", f"{0.4 * free_gib:.1f}")),
        ("the KV cache would take", ("generate", "--model", str(tiny_llama), "--prompt", "x", *over)),
    ]
    for (cause, args), r in zip(cases, run_all([[*PDSERVE, *args] for _, args in cases])):
        assert r.returncode == 2, (args, r.stderr)
        assert cause in r.stderr, (args, r.stderr)
        assert "Traceback" not in r.stderr and "redis-server" not in r.stderr, r.stderr
        assert r.stderr.strip().splitlines()[-1].startswith(f"pdserve {args[0]}: error: ")
