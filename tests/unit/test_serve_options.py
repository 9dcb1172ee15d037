"""`pdserve serve`'s flags reach the config the engines are built from, with the config's
own validation (cluster/launch/options.py)."""

import dataclasses
import json
import os
import socket

import pytest

from cluster.cli import build_parser
from cluster.config import LOCAL_SERVE_ENVIRONMENT, ClusterConfig, from_dict
from cluster.launch import ingress, planner, ports
from cluster.launch.serve import config_from_args
from cluster.planner.costs import EngineCosts
from cluster.planner.policy import SloPlanner
from cluster.planner.profile import Profile


def config_of(*flags: str):
    return config_from_args(build_parser().parse_args(["serve", *flags]))


def test_scheduler_flags_reach_every_tier_engine():
    """Every engine gets the step budget, but a disaggregated decode tier's holds prompt work
    beside its decodes to --decode-step-slowdown, with no minimum chunk (decode protection)."""
    config = config_of("--max-num-batched-tokens", "512", "--max-step-slowdown", "1.5", "--decode-step-slowdown", "1.1")
    schedulers = {role: config.engine_for(tier, role).scheduler for role, tier in (("prefill", config.prefill),
                                                                                  ("decode", config.decode))}
    assert [(s.max_num_batched_tokens, s.max_step_slowdown, s.min_prompt_chunk) for s in schedulers.values()] == [
        (512, 1.5, 32), (512, 1.1, 1)]
    colocated = config_of("--colocated", "--max-step-slowdown", "1.5")
    assert colocated.engine_for(colocated.decode, "decode").scheduler == colocated.engine.scheduler
    defaults = config_of()
    assert (defaults.engine.scheduler.max_num_batched_tokens, defaults.engine.scheduler.max_step_slowdown) == (2048, 2.0)
    assert defaults.scheduler_for("decode").max_step_slowdown == defaults.decode_step_slowdown == 1.2


@pytest.mark.parametrize("bench", [
    ["compare", "--target-a", "colocated", "--target-b", "1p1d"],
    ["chaos"],
    ["cluster", "--model", "m"],
])
def test_benchmarks_local_engines_default_to_serves_step_budget(bench):
    args = build_parser().parse_args(["bench", *bench])
    serves = config_of().engine.scheduler
    assert args.chunk == serves.max_num_batched_tokens
    if hasattr(args, "max_step_slowdown"):
        assert args.max_step_slowdown == serves.max_step_slowdown


def test_a_step_slowdown_below_one_is_refused():
    with pytest.raises(ValueError, match="max_step_slowdown"):
        config_of("--max-step-slowdown", "0.5")


def test_kv_cache_dtype_flag_reaches_every_tier_engine_and_bad_ones_are_refused():
    config = config_of("--kv-cache-dtype", "bfloat16")
    assert {config.engine_for(config.prefill, "prefill").cache.dtype, config.engine_for(config.decode, "decode").cache.dtype} == {
        "bfloat16"}
    assert config_of().engine.cache.dtype == "auto"
    with pytest.raises(SystemExit):  # argparse: not one of the choices
        config_of("--kv-cache-dtype", "float16")
    with pytest.raises(ValueError, match="KV cache dtype must be one of"):  # Serve YAML args go through the config too
        from_dict(ClusterConfig, {"engine": {"model": "m", "cache": {"dtype": "int8"}}})


def test_ingress_flag_and_its_ray_settings():
    assert config_of().ingress == "auto"
    assert config_of("--ingress", "proxy").ingress == "proxy"
    with pytest.raises(SystemExit):  # argparse: not one of the choices
        config_of("--ingress", "haproxy")
    with pytest.raises(ValueError, match="ingress must be one of"):  # Serve YAML args go through the config too
        from_dict(ClusterConfig, {"engine": {"model": "m"}, "ingress": "haproxy"})
    proxy = ingress.environment("proxy", local=True)
    assert proxy == {"RAY_SERVE_ENABLE_DIRECT_INGRESS": "0", "RAY_SERVE_ENABLE_HA_PROXY": "0",
                     "RAY_SERVE_GRPC_MAX_MESSAGE_SIZE": str(4 << 20)}  # gRPC messages: the HTTP body limit
    direct = ingress.environment("direct", local=True)
    assert direct["RAY_SERVE_ENABLE_DIRECT_INGRESS"] == direct["RAY_SERVE_ENABLE_HA_PROXY"] == "1"
    assert float(direct["RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S"]) < 30  # not Serve's 30 s per stopping gateway
    # Serve's throughput mode comes with HAProxy; its router on a loop of its own (drivers'
    # handles), its logs on stderr (the console shows the deployment's progress)
    assert direct["RAY_SERVE_THROUGHPUT_OPTIMIZED"] == direct["RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP"] == "1"
    assert direct["RAY_SERVE_LOG_TO_STDERR"] == "1"
    assert "RAY_SERVE_THROUGHPUT_OPTIMIZED" not in proxy
    # A local Ray's HAProxy listens for metrics and stats on ports of its own, not the fixed defaults.
    assert len({direct["RAY_SERVE_HAPROXY_METRICS_PORT"], direct["RAY_SERVE_HAPROXY_STATS_PORT"], "9101", "8404"}) == 4
    assert "RAY_SERVE_HAPROXY_METRICS_PORT" not in ingress.environment("direct", local=False)


def test_chosen_ports_are_free_and_never_ones_the_os_hands_out():
    """Ray's processes take their ports from the OS's bind(0) range after these are chosen:
    HAProxy's, and those free_port gives a redis-server or a test's `pdserve serve`."""
    low, high = ports.ephemeral_ports()
    for _ in range(20):
        env = ingress.environment("direct", local=True)
        metrics, stats = int(env["RAY_SERVE_HAPROXY_METRICS_PORT"]), int(env["RAY_SERVE_HAPROXY_STATS_PORT"])
        assert metrics != stats
        for port in (metrics, stats):
            assert port in ports.SAFE_PORTS and not low <= port <= high
            with socket.socket() as s:  # free on every interface, bound as HAProxy binds it:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a closed server's TIME_WAIT does not count
                s.bind(("0.0.0.0", port))
    chosen = {ports.free_port() for _ in range(20)}
    assert all(p in ports.SAFE_PORTS and not low <= p <= high for p in chosen) and len(chosen) > 1


def test_ingress_settings_last_only_while_a_local_ray_starts(monkeypatch):
    monkeypatch.setenv("RAY_SERVE_ENABLE_HA_PROXY", "was set")
    monkeypatch.delenv("RAY_SERVE_ENABLE_DIRECT_INGRESS", raising=False)
    monkeypatch.delenv("RAY_SERVE_CONTROL_LOOP_INTERVAL_S", raising=False)
    with ingress.settings("direct") as mode:
        assert mode == "direct"
        assert os.environ["RAY_SERVE_ENABLE_DIRECT_INGRESS"] == os.environ["RAY_SERVE_ENABLE_HA_PROXY"] == "1"
        assert os.environ["RAY_SERVE_CONTROL_LOOP_INTERVAL_S"] == LOCAL_SERVE_ENVIRONMENT["RAY_SERVE_CONTROL_LOOP_INTERVAL_S"]
    assert os.environ["RAY_SERVE_ENABLE_HA_PROXY"] == "was set"
    assert "RAY_SERVE_ENABLE_DIRECT_INGRESS" not in os.environ and "RAY_SERVE_CONTROL_LOOP_INTERVAL_S" not in os.environ
    monkeypatch.setenv("RAY_SERVE_CONTROL_LOOP_INTERVAL_S", "0.1")  # the user's own interval wins
    with ingress.settings("proxy"):
        assert os.environ["RAY_SERVE_CONTROL_LOOP_INTERVAL_S"] == "0.1"
    assert os.environ["RAY_SERVE_CONTROL_LOOP_INTERVAL_S"] == "0.1"


def test_planner_flags_make_the_serve_config_with_the_application_level_policy():
    """--planner slo: both tiers autoscaled within the planner's bounds with no delay of
    Serve's own, and the policy (an import path and JSON arguments) for the application's
    config, the budget this machine's cores; the args survive the round trip through Serve's
    config. Bad bounds, colocated and inline API keys are refused."""
    config = planner.planned(config_of("--planner", "slo", "--slo-ttft-ms", "800", "--slo-itl-ms", "40",
                                       "--decode-max-replicas", "3", "--planner-interval-s", "2"))
    assert (config.prefill.autoscaling["min_replicas"], config.prefill.autoscaling["max_replicas"]) == (0, 1)
    assert (config.decode.autoscaling["min_replicas"], config.decode.autoscaling["max_replicas"]) == (1, 3)
    assert config.decode.autoscaling["initial_replicas"] == 1 and config.decode.autoscaling["downscale_delay_s"] == 0
    policy = planner.policy(config, local=True)
    assert policy["policy_function"] == "cluster.planner.policy:SloPlanner"
    kwargs = json.loads(json.dumps(policy["policy_kwargs"]))  # JSON, as Serve requires
    assert (kwargs["ttft_ms"], kwargs["itl_ms"], kwargs["interval_s"]) == (800, 40, 2)
    assert kwargs["bounds"]["budget"] == os.cpu_count() and kwargs["tiers"] == {"prefill": "PrefillWorker", "decode": "DecodeWorker"}
    assert planner.policy(config, local=False)["policy_kwargs"]["bounds"]["budget"] == 1 + 3  # every tier at its max
    assert from_dict(ClusterConfig, json.loads(json.dumps(dataclasses.asdict(config)))) == config
    assert planner.planned(config_of()) == config_of()  # off: as before
    for flags, error in ((("--planner", "slo", "--prefill-min-replicas", "2"), "min_prefill <= max_prefill"),
                         (("--planner", "slo", "--colocated"), "not with colocated"),
                         (("--planner", "slo", "--api-key", "sk-x"), "--api-key-file")):
        with pytest.raises(ValueError, match=error):
            planner.planned(config_of(*flags))


def test_a_planner_profile_seeds_the_policy_and_a_bad_one_is_refused_before_anything_starts(tmp_path):
    costs = EngineCosts(decode_base_s=0.02, decode_per_seq_s=0.001, prompt_base_s=0.01, prompt_per_token_s=0.002,
                        chunk_tokens=512)
    good = tmp_path / "profile.json"
    Profile(prefill=costs, decode=costs, decode_step_slowdown=1.2, colocated_step_slowdown=2.0,
            colocated_min_prompt_chunk=32).save(good)
    config = planner.planned(config_of("--planner", "slo", "--planner-profile", str(good)))
    kwargs = json.loads(json.dumps(planner.policy(config, local=True)["policy_kwargs"]))
    assert kwargs["seed_costs"]["prefill"]["prompt_per_token_s"] == 0.002
    assert SloPlanner(**kwargs, clock=lambda: 0.0)._known_costs["decode"] == costs
    assert planner.policy(planner.planned(config_of("--planner", "slo")), local=True)["policy_kwargs"]["seed_costs"] is None
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    with pytest.raises(ValueError, match="not a replica profile"):
        planner.planned(config_of("--planner", "slo", "--planner-profile", str(bad)))
