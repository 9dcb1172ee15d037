"""`pdserve bench serve` against a live local cluster: a self-consistent result JSON
with vllm's keys, plots written, arrivals at the requested rate, every dataset, and
failures counted by kind."""

import asyncio
import json
import time

import pytest

from cluster.bench.decode_timeline import alone_medians, attribute, decode_timelines
from cluster.bench.serve_bench import arrival_times
from cluster.cli import build_parser
from cluster.engine.sampling_params import SamplingParams
from tests.e2e.conftest import API_KEY, MODEL_NAME


def bench(live, engine_config, tmp_path, *extra):
    args = build_parser().parse_args([
        "bench", "serve", "--base-url", live.http_url, "--model", MODEL_NAME, "--tokenizer", engine_config.model,
        "--api-key", API_KEY, "--save-result", "--result-dir", str(tmp_path), "--result-filename", "r.json",
        "--disable-tqdm", "--seed", "3", *extra,
    ])
    code = args.fn(args)
    return code, json.loads((tmp_path / "r.json").read_text())


def test_random_workload_result_is_self_consistent_with_plots(live, engine_config, tmp_path):
    code, r = bench(live, engine_config, tmp_path, "--dataset-name", "random", "--num-prompts", "12", "--random-input-len",
                    "24", "--random-output-len", "6", "--random-range-ratio", "0.5", "--request-rate", "8",
                    "--ignore-eos", "--num-warmups", "2", "--percentile-metrics", "ttft,tpot,itl,e2el",
                    "--metric-percentiles", "50,99", "--goodput", "ttft:60000", "--metadata", "run=ci")
    assert code == 0
    assert r["completed"] + r["failed"] == r["num_prompts"] == 12 and r["failed"] == 0
    assert all(t <= e for t, e in zip(r["ttfts"], r["e2els"]))
    assert r["total_output_tokens"] == sum(r["output_lens"]) and all(3 <= n <= 9 for n in r["output_lens"])  # ignore_eos
    for key in ("duration", "request_throughput", "output_throughput", "total_token_throughput", "request_goodput",
                "mean_ttft_ms", "median_ttft_ms", "std_ttft_ms", "p99_ttft_ms", "p50_tpot_ms", "p99_itl_ms", "p99_e2el_ms"):
        assert isinstance(r[key], float), key
    assert r["request_goodput"] == pytest.approx(r["request_throughput"])  # a 60 s TTFT SLO: everyone meets it
    assert r["run"] == "ci"
    # Arrivals follow the schedule: seeded gaps, never early (sleep never returns early).

    schedule = arrival_times(12, 8.0, 1.0, 3)
    assert schedule[-1] == pytest.approx(12 / 8.0)
    assert all(a >= s - 1e-3 for a, s in zip(r["arrival_times"], schedule))
    server = r["server_metrics"]
    assert server["kv_transfer_bytes"] > 0 and 0 <= server["prefill_prefix_cache_hit_rate"] <= 1
    for suffix in ("-latency_cdf.png", "-throughput.png"):
        assert (tmp_path / f"r{suffix}").stat().st_size > 10_000


def test_prefix_repetition_on_chat_and_multi_turn(live, engine_config, tmp_path):
    code, r = bench(live, engine_config, tmp_path, "--endpoint", "/v1/chat/completions", "--dataset-name",
                    "prefix_repetition", "--num-prompts", "8", "--prefix-repetition-prefix-len", "48",
                    "--prefix-repetition-suffix-len", "8", "--prefix-repetition-num-prefixes", "2",
                    "--prefix-repetition-output-len", "4", "--max-concurrency", "2", "--ignore-eos")
    assert code == 0 and r["completed"] == 8 and r["backend"] == "openai-chat"
    assert r["server_metrics"]["prefill_prefix_cache_hit_rate"] > 0.3  # the prefixes repeat
    code, r = bench(live, engine_config, tmp_path, "--endpoint", "/v1/chat/completions", "--dataset-name", "multi_turn",
                    "--num-prompts", "2", "--random-input-len", "12", "--random-output-len", "4", "--ignore-eos")
    assert code == 0 and r["completed"] == 8  # 2 conversations x 4 turns
    assert max(r["input_lens"]) > min(r["input_lens"]) + 30  # the 4th turn carries 3 turns and replies more
    assert r["server_metrics"]["decode_prefix_cache_hit_rate"] > 0  # later turns reuse earlier turns' KV


def test_long_prompts_sent_beside_the_workload_are_recorded_apart(live, engine_config, tmp_path):
    """--interference-*: the long prompts' TTFTs and first-to-second token gaps, not the
    workload's figures."""
    # A workload of ~1 s or more (the tiny model streams ~1 ms a token): long prompts end within it.
    code, r = bench(live, engine_config, tmp_path, "--dataset-name", "random", "--num-prompts", "6", "--random-input-len",
                    "16", "--random-output-len", "300", "--ignore-eos", "--max-concurrency", "2", "--interference-rate", "20",
                    "--interference-input-len", "120", "--interference-output-len", "2")
    assert code == 0 and r["completed"] == 6 and r["output_lens"] == [300] * 6
    interference = r["interference"]
    assert interference["completed"] >= 1 and interference["failed"] == 0
    assert len(interference["ttfts_ms"]) == interference["completed"]
    # (timed from the first chunk with text: a request whose first token has none may have no gap to time)
    assert 1 <= len(interference["first_to_second_token_ms"]) <= interference["completed"]
    assert all(ms > 0 for ms in interference["ttfts_ms"] + interference["first_to_second_token_ms"])


def test_protect_reports_each_cell_of_its_grid_with_a_plot(live, engine_config, tmp_path):
    """`pdserve bench protect` against a URL: one decode mix, two long-prompt lengths: each
    cell's alone and beside runs, the long prompts' gaps, the prefill tier's busy time."""
    args = build_parser().parse_args([
        "bench", "protect", "--target", live.http_url, "--local-model", engine_config.model, "--api-key", API_KEY,
        "--running", "2", "--output-lens", "300", "--requests-per-decode", "2", "--decode-input-len", "16",
        "--prompt-lens", "60,120", "--arrival-rates", "20", "--result-dir", str(tmp_path), "--disable-tqdm",
    ])
    assert args.fn(args) == 0
    result = json.loads((tmp_path / "protect.json").read_text())
    (mix,) = result["mixes"]
    assert (mix["running"], mix["output_len"]) == (2, 300)
    assert [(c["prompt_len"], c["arrival_rate"]) for c in mix["cells"]] == [(60, 20.0), (120, 20.0)]
    for cell in mix["cells"]:
        assert cell["p99_itl_inflation"] == pytest.approx(cell["p99_itl_beside_ms"] / cell["p99_itl_alone_ms"])
        assert cell["long_prompts_ended"] >= 1 and cell["long_prompts_failed"] == cell["decodes_failed"] == 0
        assert 0 < cell["prefill_busy"] and cell["saturated"] == (cell["prefill_busy"] >= 0.9)
    assert result["summary"]["median_p99_itl_inflation"] > 0 and result["cpu"]
    assert (tmp_path / "protect.png").stat().st_size > 0


def test_the_decode_tier_accounts_for_every_step_it_decoded(live):
    """The decode workers' step timelines (what `bench protect` reads on a local target):
    two streams prefilled on the prefill tier decode every token after their first in
    the decode worker's steps, each step's CPU within its time."""
    since = time.time()

    async def stream(ids):
        return [t async for out in live.handle.options(stream=True).generate.remote(ids, params) for t in out.new_token_ids]

    async def both():
        return await asyncio.gather(stream(list(range(100, 140))), stream(list(range(200, 230))))

    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    assert [len(tokens) for tokens in asyncio.run(both())] == [20, 20]
    timelines = decode_timelines(since)
    (steps,) = timelines.values()
    assert sum(s["decode"] for s in steps) == 2 * 19 and sum(s["prompt"] for s in steps) == 0
    assert all(s["t"] >= since and 0 <= s["cpu_s"] <= s["step_s"] + 0.002 and s["between_s"] >= 0 for s in steps)
    account = attribute(timelines, alone_medians(timelines))
    assert account["decode_steps"] == len(steps) and account["p99_interval_ms"] > 0


def test_failures_are_counted_by_kind(live, engine_config, tmp_path):
    args = build_parser().parse_args([
        "bench", "serve", "--base-url", live.http_url, "--model", MODEL_NAME, "--tokenizer", engine_config.model,
        "--api-key", "wrong", "--num-prompts", "3", "--random-input-len", "8", "--random-output-len", "2",
        "--disable-tqdm", "--save-result", "--result-dir", str(tmp_path), "--result-filename", "bad.json",
    ])
    assert args.fn(args) == 1  # nothing completed
    r = json.loads((tmp_path / "bad.json").read_text())
    assert r["completed"] == 0 and r["failed"] == 3 and r["failure_breakdown"] == {"http_401": 3}


def test_sweep_reports_attainment_per_rate_with_a_plot(live, engine_config, tmp_path):
    args = build_parser().parse_args([
        "bench", "sweep", "--base-url", live.http_url, "--model", MODEL_NAME, "--tokenizer", engine_config.model,
        "--api-key", API_KEY, "--num-prompts", "6", "--random-input-len", "16", "--random-output-len", "4", "--ignore-eos",
        "--request-rates", "2,8", "--slo-ttft-ms", "60000", "--slo-tpot-ms", "60000", "--disable-tqdm",
        "--result-dir", str(tmp_path),
    ])
    assert args.fn(args) == 0
    sweep = json.loads((tmp_path / "sweep.json").read_text())
    assert [p["request_rate"] for p in sweep["points"]] == [2.0, 8.0]
    assert all(p["attainment"] == 1.0 for p in sweep["points"])  # SLOs of a minute: all meet them
    assert sweep["max_rate_meeting_slo"] == 8.0
    assert (tmp_path / "sweep-attainment.png").stat().st_size > 10_000


def test_compare_two_urls_reports_ratios(live, engine_config, tmp_path):
    args = build_parser().parse_args([
        "bench", "compare", "--target-a", live.http_url, "--target-b", live.http_url, "--rounds", "1",
        "--model", MODEL_NAME, "--tokenizer", engine_config.model, "--api-key", API_KEY, "--num-prompts", "4",
        "--random-input-len", "16", "--random-output-len", "4", "--ignore-eos", "--disable-tqdm", "--result-dir", str(tmp_path),
        "--result-filename", "a-vs-b.json",  # named: runs side by side in one directory keep their own results
    ])
    assert args.fn(args) == 0
    compare = json.loads((tmp_path / "a-vs-b.json").read_text())
    assert set(compare["ratios_b_over_a"]) >= {"output_throughput", "median_ttft_ms", "p99_itl_ms"}
    assert all(r["completed"] == 4 for label in ("A", "B") for r in compare["runs"][label])
    assert (tmp_path / "a-vs-b.png").exists() and not (tmp_path / "compare.json").exists()
