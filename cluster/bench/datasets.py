"""Workloads for `pdserve bench serve`, with `vllm bench serve`'s dataset names and flags.

    random             random token ids, --random-input-len / --random-output-len, lengths
                       drawn from [len * (1 - ratio), len * (1 + ratio)]; an optional shared
                       --random-prefix-len prefix
    prefix_repetition  --prefix-repetition-num-prefixes prefixes of -prefix-len tokens, each
                       prompt one of them plus a -suffix-len suffix (the prefix-cache workload)
    sharegpt           the first human turn of each ShareGPT conversation (--dataset-path),
                       the reply's length as the output length
    multi_turn         conversations whose every next turn carries the whole history
                       (ShareGPT conversations from --dataset-path, or random ones)

A request is text plus the token count it has under the model's tokenizer (prompts are
built from token ids and decoded, then re-encoded to count them honestly).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field

from cluster.text.tokenizer import Tokenizer

DATASETS = ("random", "prefix_repetition", "sharegpt", "multi_turn")
MULTI_TURN_TURNS = 4


@dataclass
class BenchRequest:
    prompt: str
    prompt_len: int
    output_len: int


@dataclass
class Conversation:
    """User turns sent in order; each request carries every earlier turn and reply."""

    user_turns: list[str]
    output_lens: list[int]
    history: list[dict] = field(default_factory=list)


def random_text(rng: random.Random, tokenizer: Tokenizer, n: int) -> str:
    """Text of (nearly always exactly) n tokens: random ids, decoded; re-encoding text
    rarely gives the same ids back, so it is re-encoded, cut or topped up, and decoded
    again until the count holds (as vLLM's random dataset does)."""
    ids = [rng.randrange(10, tokenizer.vocab_size) for _ in range(n)]
    text = tokenizer.decode(ids)
    for _ in range(10):
        again = tokenizer.encode(text, add_special_tokens=False)
        if len(again) == n:
            break
        ids = again[:n] + [rng.randrange(10, tokenizer.vocab_size) for _ in range(n - len(again))]
        text = tokenizer.decode(ids)
    return text


def _lengths(rng: random.Random, mean: int, ratio: float, count: int) -> list[int]:
    low, high = max(1, int(mean * (1 - ratio))), max(1, int(mean * (1 + ratio)))
    return [rng.randint(low, high) for _ in range(count)]


def _request(tokenizer: Tokenizer, text: str, output_len: int) -> BenchRequest:
    return BenchRequest(text, len(tokenizer.encode(text)), output_len)


def random_requests(args, tokenizer: Tokenizer) -> list[BenchRequest]:
    rng = random.Random(args.seed)
    prefix = random_text(rng, tokenizer, args.random_prefix_len) if args.random_prefix_len else ""
    ins = _lengths(rng, args.random_input_len, args.random_range_ratio, args.num_prompts)
    outs = _lengths(rng, args.random_output_len, args.random_range_ratio, args.num_prompts)
    return [_request(tokenizer, prefix + random_text(rng, tokenizer, i), o) for i, o in zip(ins, outs)]


def interference_requests(args, tokenizer: Tokenizer, count: int) -> list[BenchRequest]:
    """Long prompts sent beside the measured workload (--interference-*): the load that
    tests how much other requests' prompts stall the measured decodes."""
    rng = random.Random(args.seed + 1)
    return [_request(tokenizer, random_text(rng, tokenizer, args.interference_input_len), args.interference_output_len)
            for _ in range(count)]


def prefix_repetition_requests(args, tokenizer: Tokenizer) -> list[BenchRequest]:
    rng = random.Random(args.seed)
    prefixes = [random_text(rng, tokenizer, args.prefix_repetition_prefix_len) for _ in range(args.prefix_repetition_num_prefixes)]
    hot = round(args.num_prompts * args.prefix_repetition_hot_fraction)  # skew: this many share prefix 0
    requests = [
        _request(tokenizer, prefixes[0 if i < hot else i % len(prefixes)] + random_text(rng, tokenizer, args.prefix_repetition_suffix_len),
                 args.prefix_repetition_output_len)
        for i in range(args.num_prompts)
    ]
    rng.shuffle(requests)
    return requests


def _sharegpt(path: str) -> list[list[dict]]:
    data = json.loads(open(path).read())
    conversations = []
    for item in data:
        turns = item.get("conversations") or item.get("conversation") or []
        turns = [t for t in turns if t.get("value")]
        if len(turns) >= 2 and turns[0].get("from") in ("human", "user"):
            conversations.append(turns)
    if not conversations:
        raise ValueError(f"{path}: no ShareGPT conversations (a list of {{'conversations': [{{'from', 'value'}}, ...]}})")
    return conversations


def sharegpt_requests(args, tokenizer: Tokenizer) -> list[BenchRequest]:
    if not args.dataset_path:
        raise ValueError("--dataset-name sharegpt needs --dataset-path (a ShareGPT JSON file)")
    rng = random.Random(args.seed)
    conversations = _sharegpt(args.dataset_path)
    rng.shuffle(conversations)
    requests = []
    for turns in conversations:
        request = _request(tokenizer, turns[0]["value"], max(1, len(tokenizer.encode(turns[1]["value"]))))
        if request.prompt_len >= 4 and request.output_len >= 4:  # as vLLM filters: too short to measure
            requests.append(request)
        if len(requests) == args.num_prompts:
            break
    return requests


def multi_turn_conversations(args, tokenizer: Tokenizer) -> list[Conversation]:
    """--num-prompts conversations of MULTI_TURN_TURNS turns (ShareGPT's own turns if given)."""
    rng = random.Random(args.seed)
    if args.dataset_path:
        out = []
        for turns in _sharegpt(args.dataset_path)[: args.num_prompts]:
            users = [t["value"] for t in turns if t.get("from") in ("human", "user")]
            replies = [max(1, len(tokenizer.encode(t["value"]))) for t in turns if t.get("from") in ("gpt", "assistant")]
            n = min(len(users), len(replies))
            out.append(Conversation(users[:n], replies[:n]))
        return out
    return [
        Conversation(
            [random_text(rng, tokenizer, n) for n in _lengths(rng, args.random_input_len, args.random_range_ratio, MULTI_TURN_TURNS)],
            _lengths(rng, args.random_output_len, args.random_range_ratio, MULTI_TURN_TURNS),
        )
        for _ in range(args.num_prompts)
    ]


def load(args, tokenizer: Tokenizer) -> list[BenchRequest] | list[Conversation]:
    if args.dataset_name == "multi_turn":
        return multi_turn_conversations(args, tokenizer)
    return {"random": random_requests, "prefix_repetition": prefix_repetition_requests, "sharegpt": sharegpt_requests}[
        args.dataset_name
    ](args, tokenizer)
