"""deploy/cluster.yaml against Ray's own cluster-config schema, deploy/serve.yaml against
Serve's own config schema, and the two against each other and cluster/config.py.

No Ray cluster is started: only Ray's schema files and pydantic models are used."""

from __future__ import annotations

import copy
import json
import os
import warnings
from pathlib import Path

import jsonschema
import pytest
import ray.autoscaler
import yaml
from ray.autoscaler._private.util import prepare_config, validate_config

with warnings.catch_warnings():  # ray.serve's pydantic models still use v1-style Field(...) extras
    warnings.simplefilter("ignore", DeprecationWarning)
    from ray.serve.config import AutoscalingConfig
    from ray.serve.schema import DeploymentSchema, RayActorOptionsSchema, ServeApplicationSchema, ServeDeploySchema

from cluster.config import RAY_SYSTEM_CONFIG, ClusterConfig, from_dict
from cluster.launch import ingress
from cluster.launch.app import GRPC_SERVICER_FUNCTIONS, build_app, tier_options

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
RAY_SCHEMA = Path(os.path.dirname(ray.autoscaler.__file__)) / "ray-schema.json"

TIERS = {  # deployment name -> (args key, cluster.yaml node type, custom resource)
    "PrefillWorker": ("prefill", "prefill_gpu", "prefill_node"),
    "DecodeWorker": ("decode", "decode_gpu", "decode_node"),
}


def load(name: str) -> dict:
    with open(DEPLOY / name) as f:
        return yaml.safe_load(f)


@pytest.fixture(scope="module")
def ray_schema() -> dict:
    with open(RAY_SCHEMA) as f:
        return json.load(f)


@pytest.fixture
def cluster() -> dict:
    return load("cluster.yaml")


@pytest.fixture
def serve() -> dict:
    return load("serve.yaml")


def app_of(serve: dict) -> dict:
    (app,) = serve["applications"]
    return app


def overrides_of(serve: dict) -> dict[str, dict]:
    return {d["name"]: d for d in app_of(serve).get("deployments", [])}


def ray_up_validate(config: dict) -> None:
    """What `ray up` does before touching the cloud: merge the provider's defaults, then
    Ray's validate_config (its JSON schema plus its cross-field checks)."""
    validate_config(prepare_config(copy.deepcopy(config)))


def autoscaling(config: dict) -> AutoscalingConfig:
    """Serve's AutoscalingConfig, strictly: Serve itself drops unknown keys silently
    (a misspelt `min_replica` would leave min_replicas at its default)."""
    unknown = set(config) - set(AutoscalingConfig.model_fields)
    assert not unknown, f"unknown autoscaling_config keys {sorted(unknown)}"
    return AutoscalingConfig.model_validate(config)


def serve_validate(config: dict) -> ServeDeploySchema:
    """What `serve deploy` does with the file (ServeDeploySchema.model_validate), plus
    what Serve leaves unchecked: autoscaling dicts are parsed as AutoscalingConfig (the
    schema keeps them as plain dicts until the controller builds the deployment), and
    keys the schema would silently ignore (a misspelt `num_replica`) are rejected."""
    schema = ServeDeploySchema.model_validate(config)
    unknown = set(config) - set(ServeDeploySchema.model_fields)
    assert not unknown, f"unknown top-level Serve config keys {sorted(unknown)}"
    for app in config["applications"]:
        unknown = set(app) - set(ServeApplicationSchema.model_fields)
        assert not unknown, f"unknown application keys {sorted(unknown)}"
        for dep in app.get("deployments", []):
            unknown = set(dep) - set(DeploymentSchema.model_fields)
            assert not unknown, f"unknown keys {sorted(unknown)} in deployment {dep['name']}"
            unknown = set(dep.get("ray_actor_options") or {}) - set(RayActorOptionsSchema.model_fields)
            assert not unknown, f"unknown ray_actor_options {sorted(unknown)} in {dep['name']}"
            if dep.get("autoscaling_config"):
                autoscaling(dep["autoscaling_config"])
    return schema


# ------------------------------------------------------------------ cluster.yaml


def test_cluster_yaml_matches_rays_schema(cluster, ray_schema):
    jsonschema.validate(cluster, ray_schema)  # the file as written
    ray_up_validate(cluster)  # and as `ray up` sees it after merging defaults


def test_cluster_yaml_has_a_gpu_free_head_and_one_gpu_node_type_per_tier(cluster):
    types = cluster["available_node_types"]
    head = types[cluster["head_node_type"]]
    assert head["resources"].get("GPU", 0) == 0
    assert not {"prefill_node", "decode_node"} & set(head["resources"])
    for _, node_type, tag in TIERS.values():
        res = types[node_type]["resources"]
        assert res["GPU"] >= 1 and res[tag] >= 1, node_type
        other = {"prefill_node", "decode_node"} - {tag}
        assert not other & set(res), f"{node_type} must not carry the other tier's tag"
    assert "--autoscaling-config=~/ray_bootstrap_config.yaml" in " ".join(cluster["head_start_ray_commands"])
    assert "$RAY_HEAD_IP" in " ".join(cluster["worker_start_ray_commands"])


def test_every_ray_start_carries_the_direct_ingress_settings(cluster):
    """Serve reads them once per process: each node's `ray start` must set what a local
    `pdserve serve` sets (cluster/launch/ingress.py), or that node's gateways sit behind proxies."""
    settings = " ".join(f"{k}={v}" for k, v in ingress.environment("direct", local=False).items())
    for key in ("head_start_ray_commands", "worker_start_ray_commands"):
        (start,) = [c for c in cluster[key] if "ray start" in c]
        assert f"{settings} ray start" in start, key
        for name, value in RAY_SYSTEM_CONFIG.items():  # what a local Ray gets (workers at nice 0)
            assert f"RAY_{name}={value} " in start, key


def test_the_cluster_is_closed_by_default(cluster, serve):
    """Ray's token authentication on every node, its token mounted on each; Redis on the
    private network with a password from a mounted secret; the API behind keys from one."""
    for key in ("head_start_ray_commands", "worker_start_ray_commands"):
        (start,) = [c for c in cluster[key] if "ray start" in c]
        assert "RAY_AUTH_MODE=token " in start, key
    assert cluster["file_mounts"]["~/.ray/auth_token"] == "~/.ray/auth_token"
    assert cluster["file_mounts"]["~/.pdserve"] == "./deploy/secrets"
    assert any("export RAY_AUTH_MODE=token" in c for c in cluster["setup_commands"])  # for drivers on the nodes
    (redis_start,) = [c for c in cluster["head_start_ray_commands"] if "redis-server" in c]
    assert "requirepass $(cat ~/.pdserve/redis-password)" in redis_start
    assert "--protected-mode yes" in redis_start and "0.0.0.0" not in redis_start
    args = app_of(serve)["args"]
    assert args["redis_url"].endswith("?password_file=~/.pdserve/redis-password")
    assert args["gateway"]["api_key_file"] == "~/.pdserve/api-keys"


def test_cluster_has_room_for_each_tiers_max_replicas(cluster, serve):
    """Every resource a tier's replica asks for exists on its node type (else Ray could
    never place it), and max_workers nodes can hold the tier's largest replica count."""
    types = cluster["available_node_types"]
    args = app_of(serve)["args"]
    for name, (key, node_type, tag) in TIERS.items():
        tier = args[key]
        node = types[node_type]
        asks = {"CPU": tier["num_cpus"], "GPU": tier["num_gpus"], **tier["resources"]}  # per TP rank
        assert asks[tag] > 0, f"{name} does not ask for {tag}"
        ranks = tier.get("tensor_parallel_size", 1)  # STRICT_PACK: a replica's ranks on one node
        per_node = min(node["resources"].get(r, 0) // (v * ranks) for r, v in asks.items() if v > 0)
        most = (tier.get("autoscaling") or {}).get("max_replicas", tier["num_replicas"])
        assert per_node * node["max_workers"] >= most, f"{node_type} cannot hold {most} {name} replicas"
        # A tier that always keeps replicas keeps a node for them, so the first request
        # does not wait for a GPU node to boot.
        least = (tier.get("autoscaling") or {}).get("min_replicas", tier["num_replicas"])
        assert least == 0 or node.get("min_workers", 0) >= 1, node_type


@pytest.mark.parametrize(
    "mutate",
    [
        pytest.param(lambda c: c.update(max_workers="four"), id="max_workers-not-an-integer"),
        pytest.param(lambda c: c.update(worker_count=4), id="unknown-top-level-key"),
        pytest.param(lambda c: c["available_node_types"]["decode_gpu"]["resources"].update(decode_node=0.5),
                     id="fractional-node-resource"),
        pytest.param(lambda c: c["available_node_types"]["prefill_gpu"].pop("node_config"), id="missing-node_config"),
        pytest.param(lambda c: c["auth"].update(ssh_usr="ubuntu"), id="misspelt-auth-key"),
    ],
)
def test_broken_cluster_yaml_fails_rays_schema(cluster, ray_schema, mutate):
    mutate(cluster)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(cluster, ray_schema)
    with pytest.raises(jsonschema.ValidationError):
        ray_up_validate(cluster)


def test_ray_up_checks_beyond_the_schema(cluster):
    cluster["head_node_type"] = "gpu_head"
    with pytest.raises(ValueError, match="head_node_type"):
        ray_up_validate(cluster)


# -------------------------------------------------------------------- serve.yaml


def test_serve_yaml_matches_serves_schema(serve):
    schema = serve_validate(serve)
    (app,) = schema.applications
    assert app.name == "pdserve" and app.route_prefix == "/"
    assert app.import_path == "cluster.launch.app:app_builder"
    assert schema.http_options.host == "0.0.0.0" and schema.http_options.port == 8000
    assert schema.grpc_options.port == 9000

    assert schema.grpc_options.grpc_servicer_functions == list(GRPC_SERVICER_FUNCTIONS)


def test_serve_args_parse_as_cluster_config(serve):
    cfg = from_dict(ClusterConfig, app_of(serve)["args"])
    assert cfg.engine.device == "cuda" and cfg.engine.dtype == "bfloat16"
    assert cfg.http_port == serve["http_options"]["port"]
    assert cfg.grpc_port == serve["grpc_options"]["port"]
    assert not cfg.colocated
    for _, (key, _, tag) in TIERS.items():
        tier = getattr(cfg, key)
        assert tier.num_gpus >= 1 and tier.resources[tag] > 0
        if tier.autoscaling:
            autoscaling(tier.autoscaling)
    assert cfg.prefill.resources != cfg.decode.resources
    assert cfg.router.num_gpus == 0 and not cfg.router.resources


def test_serve_deployments_scale_prefill_and_decode_separately(serve):
    args = app_of(serve)["args"]
    overrides = overrides_of(serve)
    assert set(overrides) <= {"PrefillWorker", "DecodeWorker", "Gateway"}
    assert {"PrefillWorker", "DecodeWorker"} <= set(overrides)
    scaling = {}
    for name, (key, _, tag) in TIERS.items():
        dep, tier = overrides[name], args[key]
        assert "num_replicas" in dep or dep.get("autoscaling_config"), f"{name} has no scaling setting"
        # ray_actor_options replace the code's as a whole: they must keep the GPU and the pin.
        opts = dep.get("ray_actor_options")
        if opts is not None:
            assert opts.get("num_gpus") == tier["num_gpus"], name
            assert opts.get("num_cpus") == tier["num_cpus"], name
            assert (opts.get("resources") or {}) == tier["resources"], f"{name} would lose its {tag} pin"
        # An int num_replicas leaves autoscaling from args in force unless it is nulled here.
        if isinstance(dep.get("num_replicas"), int) and tier.get("autoscaling"):
            assert "autoscaling_config" in dep and dep["autoscaling_config"] is None, name
        # The override and args describe the same scaling, so there is one truth.
        if "autoscaling_config" in dep:
            assert dep["autoscaling_config"] == tier.get("autoscaling"), f"{name}: deployments and args disagree"
        if dep.get("autoscaling_config"):
            target = autoscaling(dep["autoscaling_config"]).get_target_ongoing_requests()
            assert dep.get("max_ongoing_requests", 5) >= target, f"{name} could never autoscale"
        scaling[name] = (dep.get("num_replicas"), json.dumps(dep.get("autoscaling_config"), sort_keys=True))
    assert scaling["PrefillWorker"] != scaling["DecodeWorker"]


@pytest.mark.parametrize(
    "mutate, error",
    [
        pytest.param(lambda s: s.update(proxy_location="Everywhere"), ValueError, id="bad-proxy_location"),
        pytest.param(lambda s: app_of(s).update(import_path="cluster.launch.app:app:builder"), ValueError,
                     id="bad-import_path"),
        pytest.param(lambda s: overrides_of(s)["DecodeWorker"].update(num_replicas=3), ValueError,
                     id="num_replicas-with-autoscaling_config"),
        pytest.param(lambda s: overrides_of(s)["PrefillWorker"]["ray_actor_options"].update(num_gpus=-1), ValueError,
                     id="negative-num_gpus"),
        pytest.param(lambda s: overrides_of(s)["PrefillWorker"]["autoscaling_config"].update(max_replicas=0),
                     ValueError, id="max_replicas-zero"),
        pytest.param(lambda s: overrides_of(s)["PrefillWorker"]["autoscaling_config"].update(min_replica=1),
                     AssertionError, id="misspelt-autoscaling-key"),
        pytest.param(lambda s: overrides_of(s)["DecodeWorker"].update(num_replica=3), AssertionError,
                     id="misspelt-deployment-key"),
    ],
)
def test_broken_serve_yaml_fails_serves_schema(serve, mutate, error):
    mutate(serve)
    with pytest.raises(error):  # pydantic's ValidationError is a ValueError; AssertionError: our strict-key checks
        serve_validate(serve)


def test_unknown_args_key_is_rejected(serve):
    app_of(serve)["args"]["prefill"]["gpus"] = 1
    with pytest.raises(ValueError, match="unknown TierConfig keys"):
        from_dict(ClusterConfig, app_of(serve)["args"])


def test_prefill_replicas_span_two_gpus_of_one_node_and_decode_replicas_one(serve):
    """deploy/serve.yaml's TP layout: a prefill replica is a placement group of 2
    one-GPU bundles on one node (rank 0 is the replica, rank 1 takes bundle 1)."""
    cfg = from_dict(ClusterConfig, app_of(serve)["args"])
    prefill, decode = tier_options(cfg.prefill), tier_options(cfg.decode)
    rank = {"CPU": cfg.prefill.num_cpus, "GPU": 1, **cfg.prefill.resources}
    assert prefill["placement_group_bundles"] == [rank, rank] and prefill["placement_group_strategy"] == "STRICT_PACK"
    assert "placement_group_bundles" not in decode
    assert [cfg.engine_for(t, r).tensor_parallel_size for t, r in ((cfg.prefill, "prefill"), (cfg.decode, "decode"))] == [2, 1]
    build_app(cfg)  # Serve accepts the options: the replica's own resources fit bundle 0


# ------------------------------------------------------------------ rayservice.yaml (KubeRay)

GROUPS = {"PrefillWorker": ("prefill", "prefill-gpu", "prefill_node"), "DecodeWorker": ("decode", "decode-gpu", "decode_node")}


@pytest.fixture
def rayservice() -> dict:
    with open(DEPLOY / "rayservice.yaml") as f:
        docs = list(yaml.safe_load_all(f))
    (service,) = [d for d in docs if d["kind"] == "RayService"]
    return {"service": service, "docs": docs, "serve": yaml.safe_load(service["spec"]["serveConfigV2"])}


def _pods(rayservice: dict) -> dict:
    config = rayservice["service"]["spec"]["rayClusterConfig"]
    return {"head": config["headGroupSpec"], **{g["groupName"]: g for g in config["workerGroupSpecs"]}}


def test_rayservice_serves_the_same_application_as_serve_yaml(rayservice, serve):
    """serveConfigV2 passes Serve's own schema and is serve.yaml but for where the secrets
    and Redis are (mounted files, a Kubernetes service)."""
    serve_validate(rayservice["serve"])
    theirs = copy.deepcopy(rayservice["serve"])
    args = app_of(theirs)["args"]
    assert args.pop("redis_url") == "redis://pdserve-redis:6380/0?password_file=/etc/pdserve/redis-password"
    assert args["gateway"].pop("api_key_file") == "/etc/pdserve/api-keys"
    ours = copy.deepcopy(serve)
    del app_of(ours)["args"]["redis_url"], app_of(ours)["args"]["gateway"]["api_key_file"]
    assert theirs == ours
    from_dict(ClusterConfig, app_of(rayservice["serve"])["args"])  # and the args parse


def test_rayservice_pins_each_tier_to_its_own_gpu_group_with_room_for_its_replicas(rayservice):
    pods = _pods(rayservice)
    head = pods["head"]
    assert head["rayStartParams"]["num-gpus"] == "0" and "resources" not in head["rayStartParams"]
    args = app_of(rayservice["serve"])["args"]
    for _, (key, group_name, tag) in GROUPS.items():
        group = pods[group_name]
        declared = json.loads(json.loads(group["rayStartParams"]["resources"]))  # KubeRay's quoted JSON
        assert declared == {tag: 1}, group_name
        (container,) = group["template"]["spec"]["containers"]
        gpus = int(container["resources"]["limits"]["nvidia.com/gpu"])
        tier = args[key]
        ranks = tier.get("tensor_parallel_size", 1)
        per_pod = gpus // (tier["num_gpus"] * ranks)
        most = (tier.get("autoscaling") or {}).get("max_replicas", tier["num_replicas"])
        least = (tier.get("autoscaling") or {}).get("min_replicas", tier["num_replicas"])
        assert per_pod * group["maxReplicas"] >= most, group_name
        assert group["minReplicas"] >= 1 or least == 0, group_name


def test_rayservice_is_closed_by_default_and_runs_the_direct_ingress(rayservice):
    """Every Ray container: token auth with the token from the secret, the ingress settings
    a local `pdserve serve` sets, replicas at nice 0; the secrets mounted, never inline;
    Redis with the password, in the cluster only."""
    wanted = {**ingress.environment("direct", local=False), **{f"RAY_{k}": str(v) for k, v in RAY_SYSTEM_CONFIG.items()},
              "RAY_AUTH_MODE": "token"}
    for name, group in _pods(rayservice).items():
        spec = group["template"]["spec"]
        for container in spec["containers"]:
            env = {e["name"]: e.get("value") for e in container["env"]}
            assert {k: env.get(k) for k in wanted} == wanted, name
            (token,) = [e for e in container["env"] if e["name"] == "RAY_AUTH_TOKEN"]
            assert token["valueFrom"]["secretKeyRef"] == {"name": "pdserve-secrets", "key": "ray-auth-token"}
            assert {"name": "pdserve-secrets", "mountPath": "/etc/pdserve", "readOnly": True} in container["volumeMounts"]
        (secret,) = [v for v in spec["volumes"] if v["name"] == "pdserve-secrets"]
        assert secret["secret"]["secretName"] == "pdserve-secrets"
    (redis,) = [d for d in rayservice["docs"] if d["kind"] == "Deployment"]
    (command,) = [" ".join(c["command"]) for c in redis["spec"]["template"]["spec"]["containers"]]
    assert "--requirepass" in command and "/etc/pdserve/redis-password" in command and "--protected-mode yes" in command
    (service,) = [d for d in rayservice["docs"] if d["kind"] == "Service"]
    assert service["spec"]["type"] == "ClusterIP"
    assert "sk-" not in yaml.safe_dump_all(rayservice["docs"])  # no key inline
