"""Tensor parallelism on CPU over gloo, with real rank processes (Ray actors).

Each rank loads only its shard; TP 2 generates the same greedy tokens as TP 1 on every
family, including GQA with fewer KV heads than ranks (mistral's tiny variant: 1 KV head).
"""

import json

import pytest
import ray
import torch

from cluster.engine.engine import Engine
from cluster.engine.sampling_params import SamplingParams
from cluster.host import local_ray
from cluster.model.checkpoints import open_checkpoint
from cluster.model.families import parse_arch
from cluster.model.linear import Linear
from cluster.model.sharding import shard_of, tensor_slice
from cluster.testing.gguf_export import export_gguf
from tests.conftest import TINY_VARIANTS
from tests.integration.test_cli import run as run_pdserve

GREEDY = SamplingParams(max_tokens=12, temperature=0)
PROMPTS = ["hello world " * 5, "the quick brown fox", list(range(3, 70))]


@pytest.fixture(scope="module")
def ray_local():
    local_ray.init(4, log_to_driver=False)
    yield
    ray.shutdown()


# qwen2: biases on q/k/v, tied embeddings; llama: GGUF's permuted q/k rows, untied head.
@pytest.mark.parametrize(
    "variant,weight_type", [("qwen2", "safetensors"), ("llama", "safetensors"), ("qwen2", "Q8_0"), ("llama", "Q4_1"), ("llama", "F32")]
)
def test_each_rank_reads_exactly_its_slice(tmp_path, tiny_models, variant, weight_type):
    model = tiny_models[variant]
    if weight_type != "safetensors":
        model = export_gguf(model, tmp_path / f"m-{weight_type}.gguf", weight_type)
    checkpoint = open_checkpoint(model)
    arch = parse_arch(checkpoint.config())
    whole = dict(checkpoint.tensors())
    sliced = 0
    for rank in range(2):
        shard = shard_of(arch, rank, 2)
        for name, part in checkpoint.tensors(lambda n, s=shard: tensor_slice(n, arch, s)):
            cut = tensor_slice(name, arch, shard)
            expected = whole[name] if cut is None else whole[name].narrow(cut[0], cut[1], cut[2] - cut[1])
            assert torch.equal(part, expected), name
            sliced += cut is not None
    assert sliced >= 2 * 8  # q, k, v (weights and biases), o, gate, up, down, embedding on each rank


# Collectives through shared memory (ranks on one host, the default), and for one family
# through gloo (the path of ranks on different hosts, forced here).
CASES = [(v, v != "qwen2") for v in sorted(TINY_VARIANTS)]


@pytest.mark.parametrize(("variant", "shared_memory"), CASES)
def test_tp2_generates_the_tokens_of_tp1(ray_local, tiny_models, variant, shared_memory):
    model = str(tiny_models[variant])
    reference = [c.token_ids for c in Engine.from_pretrained(model, dtype="float32", num_threads=1).generate(PROMPTS, GREEDY)]
    engine = Engine.from_pretrained(model, dtype="float32", num_threads=1, tensor_parallel_size=2, tp_shared_memory=shared_memory)
    try:
        ranks = engine.rank_info()
        assert [r["rank"] for r in ranks] == [0, 1] and ranks[0]["pid"] != ranks[1]["pid"]
        assert {r["collectives"] for r in ranks} == {"shared memory" if shared_memory else "gloo"}
        assert [c.token_ids for c in engine.generate(PROMPTS, GREEDY)] == reference
    finally:
        engine.close()


def test_tp2_reads_its_shards_quantized_and_generates_the_tokens_of_tp1(ray_local, tiny_models, tmp_path):
    """A GGUF file's Q4_1 weights stay in their blocks on every rank: q/k/v, gate/up and the
    vocab shards cut by rows, o_proj and down_proj by whole blocks of their inputs."""
    model = str(export_gguf(tiny_models["llama"], tmp_path / "m-Q4_1.gguf", "Q4_1"))
    reference = [c.token_ids for c in Engine.from_pretrained(model, num_threads=1).generate(PROMPTS, GREEDY)]
    engine = Engine.from_pretrained(model, num_threads=1, tensor_parallel_size=2)
    try:
        linears = [m for m in engine.loaded.model.modules() if isinstance(m, Linear)]  # rank 0's, in this process
        assert {m.quantized_weight.fmt for m in linears} == {"Q4_1"}
        assert engine.loaded.dtype == torch.float32
        assert [c.token_ids for c in engine.generate(PROMPTS, GREEDY)] == reference
    finally:
        engine.close()


def test_a_model_that_does_not_split_is_refused_before_any_rank_starts(ray_local, tiny_models):
    with pytest.raises(ValueError, match="cannot split 4 attention heads"):
        Engine.from_pretrained(str(tiny_models["llama"]), dtype="float32", tensor_parallel_size=3)


def test_generate_cli_splits_the_model_or_says_why_it_cannot(tiny_models):
    model = str(tiny_models["qwen3"])
    prompt = "the quick brown fox"
    args = ["generate", "--model", model, "--prompt", prompt, "--max-tokens", "8", "--dtype", "float32", "--json"]
    two = run_pdserve(*args, "--tensor-parallel-size", "2")
    assert two.returncode == 0, two.stderr[-2000:]
    (one,) = Engine.from_pretrained(model, dtype="float32").generate([prompt], SamplingParams(max_tokens=8, temperature=0))
    assert json.loads(two.stdout.splitlines()[-1])["token_ids"] == one.token_ids
    bad = run_pdserve(*args, "-tp", "3")
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert "cannot split 4 attention heads" in bad.stderr and "over 3 tensor-parallel ranks" in bad.stderr
