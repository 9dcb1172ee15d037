"""Decode steps through DecodeGraphs' static, padded buffers (cluster/engine/decode_graphs.py)
against the same steps run eagerly. Without CUDA nothing is captured, so this checks what a
graph replays: the copy into the buffers, the padding rows and the slicing of the output."""

import pytest
import torch

from cluster.engine.decode_graphs import capture_sizes
from cluster.engine.runner import ModelRunner
from cluster.engine.scheduler import ScheduledChunk, SchedulerOutput
from cluster.model.loader import load_model
from kernels import cpu

BLOCK_SIZE = 4


def test_capture_sizes_cover_every_batch_up_to_the_largest():
    assert capture_sizes(1) == [1]
    assert capture_sizes(8) == [1, 2, 4, 8]
    assert capture_sizes(30) == [1, 2, 4, 8, 16, 24, 30]
    assert capture_sizes(64)[-3:] == [48, 56, 64]


def _step(chunks: list[ScheduledChunk]) -> SchedulerOutput:
    return SchedulerOutput(num_scheduled_tokens={c.request_id: len(c.token_ids) for c in chunks}, chunks=chunks)


@pytest.fixture(params=["c_kernels", "torch_reference"])
def cpu_ops(request, monkeypatch):
    """Both CPU paths: the C kernels (one call per step) and torch's ops (the per-op path a
    GPU takes too, its ops Triton's there)."""
    monkeypatch.setenv(cpu.SWITCH_ENV, "1" if request.param == "c_kernels" else "0")
    cpu.reload()
    yield request.param
    monkeypatch.undo()
    cpu.reload()


@pytest.fixture
def one_thread():
    """One torch thread: with two, torch's own ops (the torch_reference path) split some
    reductions by the inputs' layout, and a padded step's views (the buffers' wider block
    table) then differ from the eager step's tensors in the last bit of fp32 logits (seen
    ~1e-7). What this file checks, the buffers and the slicing, needs the same bits; the
    suite's order had set one thread already, so the test passed there and failed alone."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_padded_decode_steps_equal_eager_steps_and_leave_the_cache_alone(tiny_llama, dtype, cpu_ops, one_thread):
    loaded = load_model(tiny_llama, dtype=dtype)
    vocab = loaded.arch.vocab_size
    num_blocks = 64
    eager = ModelRunner(loaded, num_blocks, BLOCK_SIZE)
    padded = ModelRunner(loaded, num_blocks, BLOCK_SIZE, decode_graphs=12)  # buckets 1, 2, 4, 8, 12
    assert padded.decode_graphs.sizes == [1, 2, 4, 8, 12]
    for (k, v), (k2, v2) in zip(eager.kv_caches, padded.kv_caches):  # stale rows a stray write would change
        k.copy_(torch.randn(k.shape).to(k.dtype)), v.copy_(torch.randn(v.shape).to(v.dtype))
        k2.copy_(k), v2.copy_(v)

    g = torch.Generator().manual_seed(0)
    prompt_lens = [3, 9, 17, 4, 30, 1, 12, 7, 21, 5]
    blocks = torch.randperm(num_blocks, generator=g).tolist()
    tables, tokens = {}, {}
    for i, n in enumerate(prompt_lens):  # room for the prompt and 8 decoded tokens each
        width = -(-(n + 8) // BLOCK_SIZE)
        tables[f"r{i}"], blocks = blocks[:width], blocks[width:]
        tokens[f"r{i}"] = torch.randint(0, vocab, (n,), generator=g).tolist()

    def run_both(chunks: list[ScheduledChunk]) -> None:
        ids_e, logits_e = eager.execute(_step(chunks))
        ids_p, logits_p = padded.execute(_step(chunks))
        assert ids_e == ids_p
        assert torch.equal(logits_e, logits_p)
        for (k, v), (k2, v2) in zip(eager.kv_caches, padded.kv_caches):
            assert torch.equal(k, k2) and torch.equal(v, v2)
        for rid, row in zip(ids_e, logits_e):
            tokens[rid].append(int(row.argmax()))

    # The prompts in one mixed step: not decode-only, so eager on both runners.
    run_both([ScheduledChunk(rid, list(t), 0, tables[rid], True) for rid, t in tokens.items()])
    # Decode steps of every bucket's edge and between them; batches shrink and grow, so stale
    # rows and wider block tables from earlier steps sit in the buffers.
    for batch in [10, 3, 1, 8, 5, 12 - 2, 2, 7]:
        rids = list(tokens)[:batch]
        run_both([ScheduledChunk(rid, [tokens[rid][-1]], len(tokens[rid]) - 1, tables[rid], True) for rid in rids])


def test_steps_other_than_decode_only_or_beyond_the_largest_bucket_run_eagerly(tiny_llama):
    loaded = load_model(tiny_llama, dtype="float32")
    runner = ModelRunner(loaded, 16, BLOCK_SIZE, decode_graphs=2)
    graphs = runner.decode_graphs
    decode = [ScheduledChunk(f"r{i}", [5], 3, [i], True) for i in range(3)]
    prompt = ScheduledChunk("p", [1, 2, 3], 0, [9], True)
    assert graphs.takes(*_inputs(runner, decode[:2]))
    assert not graphs.takes(*_inputs(runner, decode))  # 3 > the largest bucket
    assert not graphs.takes(*_inputs(runner, decode[:1] + [prompt]))


def _inputs(runner, chunks):
    batch = runner.prepare(_step(chunks))
    return batch.input_ids, batch.meta
