"""Same tokens everywhere: the engine's greedy output equals Hugging Face transformers.

Every family and variant (tests/conftest.py: TINY_VARIANTS), fp32, a batch of prompts
of different lengths, chunked prefill forced (budget < prompt), then a second pass
whose prefixes come from the prefix cache. Logits are compared through logprobs:
|ours - HF| <= LOGPROB_ATOL at every generated position.
"""

import pytest
import torch
import transformers

from cluster.config import CacheConfig, SchedulerConfig
from cluster.engine.engine import Engine
from cluster.engine.sampling_params import SamplingParams
from tests.helpers import step_to_end

MAX_TOKENS = 12
LOGPROB_ATOL = 1e-4  # fp32; observed differences are ~1e-6
PROMPT_LENS = (5, 19, 33, 47)


def prompts_for(vocab_size: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    # Avoid the lowest ids, where the special tokens live.
    return [torch.randint(10, vocab_size, (n,), generator=g).tolist() for n in PROMPT_LENS]


def hf_greedy(model, prompt: list[int]) -> tuple[list[int], list[torch.Tensor]]:
    ids = torch.tensor([prompt])
    tokens, logprobs = [], []
    with torch.no_grad():
        for _ in range(MAX_TOKENS):
            logits = model(ids).logits[0, -1].float()
            tokens.append(int(logits.argmax()))
            logprobs.append(torch.log_softmax(logits, -1))
            ids = torch.cat([ids, torch.tensor([[tokens[-1]]])], dim=1)
    return tokens, logprobs


@pytest.mark.parametrize("variant", ["llama", "mistral", "qwen2", "qwen3"])
def test_greedy_matches_transformers(tiny_models, variant):
    model_dir = tiny_models[variant]
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    prompts = prompts_for(hf.config.vocab_size)
    expected = [hf_greedy(hf, p) for p in prompts]

    engine = Engine.from_pretrained(
        str(model_dir),
        dtype="float32",
        cache=CacheConfig(block_size=8, num_blocks=128),
        scheduler=SchedulerConfig(max_num_batched_tokens=16),  # every prompt > 16 is chunked
    )
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=3)
    for pass_no in range(2):
        outs = engine.generate(prompts, params)
        for prompt, out, (hf_tokens, hf_logprobs) in zip(prompts, outs, expected):
            assert out.token_ids == hf_tokens, f"{variant} pass {pass_no} prompt len {len(prompt)}"
            assert out.finish_reason == "length"
            for lp, ref in zip(out.logprobs, hf_logprobs):
                assert abs(lp.logprob - float(ref[lp.token_id])) <= LOGPROB_ATOL
                for tok, val in lp.top:
                    assert abs(val - float(ref[tok])) <= LOGPROB_ATOL
        if pass_no == 1:
            # Second pass: every prompt with a full block was served partly from the cache.
            assert all(o.num_cached_tokens == (len(p) - 1) // 8 * 8 for p, o in zip(prompts, outs))
        engine.check_integrity()
    assert engine.pool.num_used_blocks == 0


def test_preemption_keeps_outputs_identical(tiny_llama):
    prompts = prompts_for(500)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    roomy = Engine.from_pretrained(str(tiny_llama), dtype="float32", cache=CacheConfig(block_size=4, num_blocks=512))
    expected = [o.token_ids for o in roomy.generate(prompts, params)]

    # 20 blocks * 4 tokens = 80 tokens: the four requests (up to 71 tokens each) cannot all fit.
    tight = Engine.from_pretrained(
        str(tiny_llama),
        dtype="float32",
        max_model_len=80,
        cache=CacheConfig(block_size=4, num_blocks=20),
        scheduler=SchedulerConfig(max_num_batched_tokens=32),
    )
    ids = [tight.add_request(p, params) for p in prompts]
    requests = {rid: tight.scheduler.requests[rid] for rid in ids}
    got = step_to_end(tight)
    assert sum(r.num_preemptions for r in requests.values()) > 0
    assert [got[rid] for rid in ids] == expected
    assert tight.pool.num_used_blocks == 0
