"""`pdserve bench engine` end to end on the tiny model: consistent JSON and a plot."""

import json

from cluster.cli import main


def test_bench_engine_writes_consistent_results(tmp_path, tiny_llama):
    rc = main([
        "bench", "engine", "--model", str(tiny_llama), "--dtype", "float32",
        "--input-len", "24", "--output-len", "5", "--batch-sizes", "1,3", "--rounds", "1",
        "--threads", "1", "--result-dir", str(tmp_path),
    ])
    assert rc == 0
    (result,) = tmp_path.glob("*.json")
    data = json.loads(result.read_text())
    assert [r["batch_size"] for r in data["runs"]] == [1, 3]
    assert data["roofline_step_ms"] > 0 and data["read_bandwidth_gbs"] > 0 and data["matmul_gflops"] > 0
    for run in data["runs"]:
        ours = run["pdserve"]
        assert ours["output_tokens"] == run["batch_size"] * 5
        assert ours["prefill_s"] <= ours["total_s"]
        assert ours["prefill_gflops"] > 0
        assert run["transformers"]["decode_step_ms_mean"] > 0
    # the bound: batch 1's at least the weights' read, and more rows never lower it
    bound_one, bound_three = (run["step_bound_ms"] for run in data["runs"])
    assert data["roofline_step_ms"] < bound_one <= bound_three
    one, three = (run["pdserve"] for run in data["runs"])
    assert "step_over_first_batch" not in one
    # of one round: the ratio of that round's two runs
    assert three["step_over_first_batch"] == three["decode_step_ms_mean"] / one["decode_step_ms_mean"]
    assert (tmp_path / result.name.replace(".json", ".png")).stat().st_size > 1000
