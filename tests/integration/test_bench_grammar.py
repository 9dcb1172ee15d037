"""`pdserve bench grammar` end to end on the tiny model: a new schema compiled once, off the
engine thread, while plain requests step; a repeat compiles nothing; JSON and a plot."""

import json

from cluster.cli import main


def test_bench_grammar_measures_a_new_and_a_repeated_schema(tmp_path, tiny_llama):
    rc = main([
        "bench", "grammar", "--model", str(tiny_llama), "--dtype", "float32", "--max-model-len", "256",
        "--running", "2", "--properties", "30", "--result-dir", str(tmp_path),
    ])
    assert rc == 0
    data = json.loads((tmp_path / "grammar-compile.json").read_text())
    assert data["grammars_compiled"] == 1  # the repeated schema came from the cache
    # Both waits measured (which is shorter is the benchmark's to say, not a test's: on a busy
    # machine the repeat's wait for a step boundary can outlast the tiny schema's compile).
    assert data["new_schema"]["compile_ms"] > 0 and data["repeated_schema"]["compile_ms"] >= 0
    assert data["steady_step_ms"]["count"] > 5 and data["steady_step_ms"]["median"] > 0
    assert data["cpu"] and data["commit"]  # provenance
    assert len(data["timeline"]["t"]) == len(data["timeline"]["gap_ms"]) > 10
    assert (tmp_path / "grammar-compile.png").stat().st_size > 1000
