"""Tensor-parallel sharding arithmetic: every head, row and KV piece lands exactly once."""

import itertools

import pytest

from cluster.model.families import parse_arch
from cluster.model.sharding import ShardingError, kv_heads_of, kv_routes, shard_of, tensor_slice


def arch(heads=8, kv_heads=2, intermediate=64, vocab=101):
    return parse_arch(
        {
            "architectures": ["LlamaForCausalLM"],
            "vocab_size": vocab,
            "hidden_size": heads * 8,
            "intermediate_size": intermediate,
            "num_hidden_layers": 1,
            "num_attention_heads": heads,
            "num_key_value_heads": kv_heads,
        }
    )


@pytest.mark.parametrize("num_kv_heads,size", [(4, 1), (4, 2), (4, 4), (2, 4), (1, 2), (1, 4), (8, 2)])
def test_each_rank_holds_the_kv_heads_its_query_heads_read(num_kv_heads, size):
    a = arch(heads=8, kv_heads=num_kv_heads)
    group = a.num_heads // a.num_kv_heads  # query heads per KV head
    for rank in range(size):
        shard = shard_of(a, rank, size)
        q_heads = range(rank * shard.num_heads, (rank + 1) * shard.num_heads)
        read = {q // group for q in q_heads}
        assert read == set(range(*shard.kv_heads)), (rank, shard)


def test_vocab_shards_cover_the_vocabulary_once_with_equal_padded_rows():
    a = arch(vocab=101)
    shards = [shard_of(a, r, 4) for r in range(4)]
    assert {s.vocab_rows for s in shards} == {26}
    covered = [i for s in shards for i in range(*tensor_slice("lm_head.weight", a, s)[1:])]
    assert covered == list(range(101))


def test_indivisible_models_are_refused_with_what_does_not_divide():
    with pytest.raises(ShardingError, match="9 attention heads"):
        shard_of(arch(heads=9, kv_heads=3), 0, 2)
    with pytest.raises(ShardingError, match="3 KV heads"):
        shard_of(arch(heads=12, kv_heads=3), 0, 2)
    with pytest.raises(ShardingError, match="intermediate size 66"):
        shard_of(arch(intermediate=66), 0, 4)


@pytest.mark.parametrize("num_kv_heads,src,dst", list(itertools.product([1, 2, 4, 8], [1, 2, 4, 8], [1, 2, 4, 8])))
def test_kv_routes_give_every_destination_rank_exactly_its_heads_from_holders(num_kv_heads, src, dst):
    if (num_kv_heads % src and src % num_kv_heads) or (num_kv_heads % dst and dst % num_kv_heads):
        return
    routes = kv_routes(num_kv_heads, src, dst)
    for d in range(dst):
        got = sorted(h for r in routes if r.dst == d for h in range(r.start, r.stop))
        assert got == list(range(*kv_heads_of(d, dst, num_kv_heads)))
    for r in routes:
        lo, hi = kv_heads_of(r.src, src, num_kv_heads)
        assert lo <= r.start < r.stop <= hi
    if src > num_kv_heads and dst > 1:  # replicated source heads: the sends are spread
        assert len({r.src for r in routes}) > 1
