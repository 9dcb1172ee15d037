"""The `offline` target of `pdserve bench compare`: the workload through an engine in this
process, as the load client would send it."""

import json

import pytest

from cluster.bench.datasets import BenchRequest
from cluster.bench.offline_target import closed_loop
from cluster.cli import main
from cluster.config import CacheConfig, EngineConfig
from cluster.engine.engine import Engine
from cluster.engine.sampling_params import SamplingParams

TEXTS = ["the cat sat on", "a b c d e f", "once upon a time there", "hello", "numbers 1 2 3 4 5 6 7"]


@pytest.mark.parametrize("concurrency", [1, 2])
def test_the_closed_loop_keeps_its_concurrency_and_gives_the_greedy_texts(tiny_llama, concurrency):
    config = EngineConfig(model=str(tiny_llama), dtype="float32", cache=CacheConfig(num_blocks=64))
    engine = Engine(config)
    work = [BenchRequest(t, len(engine.tokenizer.encode(t)), 3 + i) for i, t in enumerate(TEXTS)]
    results, duration = closed_loop(engine, work, concurrency, ignore_eos=True)

    assert all(r.success for r in results)
    assert [r.output_len for r in results] == [w.output_len for w in work]  # ignore_eos: every token asked for
    assert all(len(r.itl) == r.output_len - 1 and 0 < r.ttft <= r.latency for r in results)
    spans = [(r.start, r.start + r.latency) for r in results]
    assert max(e for _, e in spans) - min(s for s, _ in spans) <= duration
    # At no request's admission were more than `concurrency` requests in flight, itself counted.
    for s, _ in spans:
        assert sum(1 for s2, e2 in spans if s2 <= s < e2) <= concurrency
    if concurrency == 1:  # one after another, in the workload's order
        assert all(e <= s for (_, e), (s, _) in zip(spans, spans[1:]))
    greedy = Engine(config).generate(TEXTS, [SamplingParams(max_tokens=w.output_len, temperature=0.0, ignore_eos=True)
                                             for w in work])
    assert [r.text for r in results] == [c.text for c in greedy]
    assert engine.pool.num_used_blocks == 0


def test_compare_offline_against_offline_writes_both_runs(tiny_llama, tmp_path):
    rc = main([
        "bench", "compare", "--target-a", "offline@1", "--target-b", "offline", "--torch-threads", "1",
        "--local-model", str(tiny_llama), "--dtype", "float32", "--num-prompts", "4", "--max-concurrency", "2",
        "--random-input-len", "12", "--random-output-len", "5", "--ignore-eos", "--rounds", "1", "--disable-tqdm",
        "--result-dir", str(tmp_path), "--result-filename", "offline.json",
    ])
    assert rc == 0
    compare = json.loads((tmp_path / "offline.json").read_text())
    for label in ("A", "B"):
        (run,) = compare["runs"][label]
        assert run["completed"] == 4 and run["failed"] == 0
        assert run["median_tpot_ms"] > 0 and run["server_metrics"]["decode_decode_step_mean_ms"] > 0
    assert (tmp_path / "offline.png").exists()


def test_the_offline_target_refuses_an_open_loop(tiny_llama, tmp_path, capsys):
    rc = main(["bench", "compare", "--target-a", "offline", "--target-b", "offline", "--local-model", str(tiny_llama),
               "--request-rate", "4", "--num-prompts", "2", "--result-dir", str(tmp_path)])
    assert rc != 0
    assert "closed loop" in capsys.readouterr().err
