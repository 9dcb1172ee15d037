"""The SLO planner on Serve: the application deployed from a config whose
application-level autoscaling policy is the planner (`pdserve serve --planner slo` does
the same: cluster/launch/planner.py), in Serve's controller, fed by the replicas'
record_autoscaling_stats. (Its parts alone: tests/unit/test_planner.py; its flags:
tests/unit/test_serve_options.py.)"""

import subprocess
import time

import httpx
import openai
import pytest
from ray import serve

from cluster.cli import main
from cluster.config import APP_NAME, ClusterConfig, PlannerConfig, TierConfig
from cluster.launch import planner
from cluster.launch.redis_server import PrivateRedis
from cluster.planner.profile import Profile
from tests.e2e.conftest import MODEL_NAME
from tests.helpers import PDSERVE, wait_until


def running(tier: str) -> int:
    deployments = serve.status().applications[APP_NAME].deployments
    return deployments[f"{tier.capitalize()}Worker"].replica_states.get("RUNNING", 0)


@pytest.fixture(scope="module")
def planned(serve_ingress, engine_config):
    with PrivateRedis() as redis:
        tier = TierConfig(num_cpus=0.5, drain_timeout_s=5.0)
        config = ClusterConfig(
            engine=engine_config, prefill=tier, decode=tier, router=TierConfig(num_cpus=0.1), redis_url=redis.url,
            # Targets any split meets at no load; a decision a second (a move: two in a row).
            planner=PlannerConfig(mode="slo", ttft_ms=5000, itl_ms=500, max_decode=1, interval_s=1.0, downscale_s=2.0),
        )
        planner.deploy(planner.planned(config), local=True)
        try:
            yield serve_ingress[0], config
        finally:
            serve.delete(APP_NAME)


def test_idle_the_planner_scales_the_prefill_tier_to_zero_and_the_decode_tier_computes_the_prompts(planned):
    """After a request, idle: 0P1D once the replicas' load windows hold no arrival
    (cluster/planner/load.py); Serve stops the prefill replica; the decode replica then
    computes every prompt, a one-token request's too; /metrics and `pdserve status` say
    what the planner decided."""
    url, config = planned
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
    assert running("prefill") == 1 and running("decode") == 1
    assert client.completions.create(model=MODEL_NAME, prompt="Hello there", max_tokens=4).usage.completion_tokens >= 1
    began = time.monotonic()
    assert wait_until(lambda: running("prefill") == 0, timeout_s=120, interval_s=0.5)
    idle_to_scaled = time.monotonic() - began
    assert running("decode") == 1
    reply = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    assert reply.usage.completion_tokens >= 1
    assert client.completions.create(model=MODEL_NAME, prompt="One", max_tokens=1).usage.completion_tokens == 1
    stats, silent = serve.get_app_handle(APP_NAME).poll_workers.remote(10.0).result()
    assert stats["prefill"] == {} and silent == {"decode": 0, "prefill": 0}
    (decode,) = stats["decode"].values()
    assert decode["local_prefills"] >= 2  # no prefill replica to ask: computed where they decode
    metrics = httpx.get(f"{url}/metrics", timeout=30).text
    assert 'pdserve_tier_replicas{tier="prefill"} 0.0' in metrics and 'pdserve_tier_replicas{tier="decode"} 1.0' in metrics
    assert 'pdserve_planner_replicas{tier="prefill"} 0.0' in metrics
    assert 'pdserve_planner_seconds{kind="target",slo="itl"} 0.5' in metrics
    status = subprocess.run([*PDSERVE, "status"], capture_output=True, text=True, timeout=120)
    assert status.returncode == 0, status.stderr
    assert status.stdout.rstrip().splitlines()[-1].startswith("planner: ")
    assert "0P1D" in status.stdout.rstrip().splitlines()[-1], (status.stdout[-500:], idle_to_scaled)


def test_bench_profile_measures_an_engine_and_a_served_request_s_overhead_for_plan(planned, engine_config, tmp_path):
    """`pdserve bench profile` fits the engine's step costs offline and measures, against the
    running cluster, what a request spends outside the engines; `pdserve plan` sizes from it."""
    url, _ = planned
    out = tmp_path / "profile.json"
    assert main(["bench", "profile", "--local-model", engine_config.model, "--dtype", "float32", "--prompt-lens", "16,64",
                 "--batch-sizes", "1,4", "--decode-steps", "8", "--rounds", "3", "--base-url", url, "--overhead-requests", "4",
                 "--out", str(out)]) == 0
    profile = Profile.load(out)
    costs = profile.decode
    assert costs.decode_base_s > 0 and costs.prompt_per_token_s > 0 and costs.chunk_tokens == 2048
    assert profile.prefill == profile.decode  # one engine measured for both tiers
    assert profile.overhead_s > 0 and profile.replica_start_s > 0 and profile.source["cpu"]
    assert profile.source["served_step_overhead_s"] >= 0
    assert main(["plan", "--profile", str(out), "--rate", "1", "--prompt-len", "32", "--output-len", "8"]) == 0
