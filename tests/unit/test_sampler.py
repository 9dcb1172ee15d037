"""Unit tests for cluster/engine/sampler.py (CPU, no Ray)."""

from __future__ import annotations

import math

import pytest
import torch

from cluster.engine.outputs import TokenLogprob
from cluster.engine.sampler import SampleInput, Sampler, _topk_rows, make_generator
from cluster.engine.sampling_params import SamplingParams as SP


def row(params: SP, prompt=(), output=(), gen: torch.Generator | None = None) -> SampleInput:
    return SampleInput(params=params, prompt_token_ids=list(prompt), output_token_ids=list(output), generator=gen)


def tokens(out: list[TokenLogprob]) -> list[int]:
    return [t.token_id for t in out]


# --------------------------------------------------------------------------- greedy


def test_greedy_returns_argmax():
    torch.manual_seed(0)
    logits = torch.randn(8, 300)
    out = Sampler()(logits, [row(SP(temperature=0.0)) for _ in range(8)])
    assert tokens(out) == logits.argmax(-1).tolist()
    # low-precision input is converted to fp32 first
    lb = logits.to(torch.bfloat16)
    out = Sampler()(lb, [row(SP(temperature=0.0)) for _ in range(8)])
    assert tokens(out) == lb.float().argmax(-1).tolist()


@pytest.mark.parametrize("top_k", [0, 1, 5])
def test_a_tiny_temperature_is_greedy_not_a_failed_step(top_k):
    """1/T of a denormal T is inf, and inf * 0 turned every weight NaN: the sampler indexed
    past its candidates and failed the whole step (found by `pdserve bench abuse --mode fuzz`)."""
    logits = torch.randn(3, 64)
    params = SP(temperature=5e-324, top_k=top_k, top_p=0.5, min_p=0.1)
    assert params.greedy and params.temperature == 0.0
    out = Sampler()(logits, [row(params)] * 3)
    assert tokens(out) == logits.argmax(-1).tolist()


@pytest.mark.parametrize("top_k", [0, 2])
def test_a_repetition_penalty_near_zero_makes_no_nan(top_k):
    """Positive logits divided by a penalty that rounds to 0 in float32 were +inf, and two
    of them NaN weights: the step failed for every request in it (fuzzing found it). Kept
    finite, the penalised tokens are the likeliest, tied."""
    logits = torch.randn(2, 4096)
    logits[:, [3, 7, 11]] = torch.tensor([1.0, 2.0, -1.0])
    params = SP(temperature=1.0, top_k=top_k, repetition_penalty=1e-46)
    out = Sampler()(logits, [row(params, prompt=[3, 7, 11]), row(params, prompt=[3, 7, 11], gen=make_generator(5))])
    assert set(tokens(out)) <= {3, 7}


def test_greedy_rows_mixed_with_random_rows_keep_argmax():
    torch.manual_seed(1)
    logits = torch.randn(6, 50)
    rows = [row(SP(temperature=0.0)) if i % 2 == 0 else row(SP(temperature=1.0, top_p=0.5)) for i in range(6)]
    out = Sampler()(logits, rows)
    for i in range(0, 6, 2):
        assert out[i].token_id == int(logits[i].argmax())


def test_repetition_penalty_positive_and_negative_logits():
    s = Sampler()
    pos = torch.tensor([[3.0, 2.8, 1.0, -1.0, -2.0]])
    # token 0 was generated: 3.0 / 1.2 = 2.5 < 2.8 -> token 1 wins
    assert s(pos, [row(SP(temperature=0.0, repetition_penalty=1.2), output=[0])])[0].token_id == 1
    # penalty too weak to flip it: 3.0 / 1.05 = 2.857 > 2.8
    assert s(pos, [row(SP(temperature=0.0, repetition_penalty=1.05), output=[0])])[0].token_id == 0
    # repetition penalty also applies to prompt tokens
    assert s(pos, [row(SP(temperature=0.0, repetition_penalty=1.2), prompt=[0])])[0].token_id == 1
    # ... but only to tokens that occurred
    assert s(pos, [row(SP(temperature=0.0, repetition_penalty=1.2), prompt=[2, 3], output=[4])])[0].token_id == 0
    # negative logits are MULTIPLIED by the penalty: -1.0 * 1.2 = -1.2 < -1.1
    neg = torch.tensor([[-1.0, -1.1, -5.0]])
    assert s(neg, [row(SP(temperature=0.0))])[0].token_id == 0
    assert s(neg, [row(SP(temperature=0.0, repetition_penalty=1.2), output=[0])])[0].token_id == 1
    # a penalty < 1 boosts: 2.8 / 0.9 = 3.11 > 3.0
    assert s(pos, [row(SP(temperature=0.0, repetition_penalty=0.9), output=[1])])[0].token_id == 1


def test_presence_and_frequency_penalties_by_hand():
    s = Sampler()
    logits = torch.tensor([[2.0, 1.5, 1.2, 0.0]])
    g = dict(temperature=0.0)
    # frequency: 2.0 - 3 * 0.2 = 1.4 < 1.5 ; 2.0 - 3 * 0.1 = 1.7 > 1.5
    assert s(logits, [row(SP(**g, frequency_penalty=0.2), output=[0, 0, 0])])[0].token_id == 1
    assert s(logits, [row(SP(**g, frequency_penalty=0.1), output=[0, 0, 0])])[0].token_id == 0
    # presence counts once however often the token occurred: 2.0 - 0.4 = 1.6 > 1.5
    assert s(logits, [row(SP(**g, presence_penalty=0.4), output=[0] * 10)])[0].token_id == 0
    assert s(logits, [row(SP(**g, presence_penalty=0.6), output=[0])])[0].token_id == 1
    # presence / frequency ignore the prompt
    assert s(logits, [row(SP(**g, presence_penalty=2.0, frequency_penalty=2.0), prompt=[0, 0])])[0].token_id == 0
    # combined: t0 = 2.0 - 0.5 - 2*0.2 = 1.1 ; t1 = 1.5 - 0.5 - 0.2 = 0.8 ; t2 = 1.2 -> token 2
    assert s(logits, [row(SP(**g, presence_penalty=0.5, frequency_penalty=0.2), output=[0, 1, 0])])[0].token_id == 2
    # ... and with presence 0.3: t0 = 2.0 - 0.3 - 0.4 = 1.3 > 1.2 -> token 0
    assert s(logits, [row(SP(**g, presence_penalty=0.3, frequency_penalty=0.2), output=[0, 1, 0])])[0].token_id == 0
    # negative penalties encourage: t3 = 0 + 1.0 + 2*0.6 = 2.2 > 2.0
    assert s(logits, [row(SP(**g, presence_penalty=-1.0, frequency_penalty=-0.6), output=[3, 3])])[0].token_id == 3


def _reference_penalties(logits: torch.Tensor, rows: list[SampleInput]) -> torch.Tensor:
    """Dense, obviously-correct vLLM penalties, one row and one token at a time."""
    out = logits.clone().double()
    for i, r in enumerate(rows):
        p = r.params
        seen = set(r.prompt_token_ids) | set(r.output_token_ids)
        for t in seen:
            v = out[i, t].item()
            out[i, t] = v / p.repetition_penalty if v > 0 else v * p.repetition_penalty
        for t in set(r.output_token_ids):
            c = list(r.output_token_ids).count(t)
            out[i, t] -= p.frequency_penalty * c + p.presence_penalty
    return out


def test_penalties_match_reference_in_mixed_batch():
    gen = torch.Generator().manual_seed(7)
    n, vocab = 12, 64
    logits = torch.randn(n, vocab, generator=gen) * 3
    rows = []
    for i in range(n):
        prompt = torch.randint(0, vocab, (20,), generator=gen).tolist()
        output = torch.randint(0, vocab, (15,), generator=gen).tolist()
        if i % 3 == 0:
            params = SP(temperature=0.0)  # no penalties at all
        else:
            params = SP(
                temperature=0.0,
                repetition_penalty=[1.0, 1.3, 0.8][i % 3],
                presence_penalty=[0.0, 0.5, -0.7][(i // 3) % 3],
                frequency_penalty=[0.25, 0.0, 1.1][(i // 2) % 3],
            )
        rows.append(row(params, prompt, output))
    before = logits.clone()
    expected = _reference_penalties(logits, rows)
    got = Sampler._apply_penalties(logits, rows)
    torch.testing.assert_close(got.double(), expected, rtol=1e-6, atol=1e-5)
    assert torch.equal(logits, before), "the caller's logits must not be modified"
    out = Sampler()(logits, rows)
    assert tokens(out) == expected.argmax(-1).tolist()
    assert torch.equal(logits, before)


def test_out_of_range_token_ids_rejected():
    with pytest.raises(ValueError):
        Sampler()(torch.zeros(1, 10), [row(SP(temperature=0.0, frequency_penalty=0.5), output=[10])])


def test_shape_mismatch_and_empty_batch():
    s = Sampler()
    assert s(torch.zeros(0, 10), []) == []
    with pytest.raises(ValueError):
        s(torch.zeros(2, 10), [row(SP())])


# -------------------------------------------------------------- seeded sampling

CONFIGS = [
    dict(temperature=1.0),
    dict(temperature=0.7, top_k=40),
    dict(temperature=1.0, top_p=0.9),
    dict(temperature=1.3, min_p=0.05),
    dict(temperature=0.9, top_k=100, top_p=0.8, min_p=0.02),
    dict(temperature=1.0, top_p=0.6, min_p=0.1),
]


def _draws(logits_row: torch.Tensor, params: SP, seed: int, steps: int, others: list[SampleInput] | None = None,
           at: int = 0, other_logits: torch.Tensor | None = None) -> list[int]:
    """Sample `steps` tokens from one seeded row, optionally inside a batch."""
    s = Sampler()
    gen = make_generator(seed)
    seq = []
    for _ in range(steps):
        me = row(params, gen=gen)
        if others is None:
            out = s(logits_row.unsqueeze(0), [me])
            seq.append(out[0].token_id)
        else:
            batch_rows = list(others)
            batch_rows.insert(at, me)
            lg = torch.cat([other_logits[:at], logits_row.unsqueeze(0), other_logits[at:]])
            out = s(lg, batch_rows)
            seq.append(out[at].token_id)
    return seq


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_seeded_sampling_reproducible_and_batch_independent(cfg):
    g = torch.Generator().manual_seed(11)
    vocab = 2000
    logits = torch.randn(vocab, generator=g)  # high entropy
    params = SP(**cfg)
    a = _draws(logits, params, seed=1234, steps=50)
    b = _draws(logits, params, seed=1234, steps=50)
    assert a == b
    assert len(set(a)) > 10  # really random, not stuck on one token

    # Same seeded row inside a busy batch: other seeded rows, unseeded rows, greedy,
    # penalties, the same and other filters, at a different position -> same tokens.
    other_logits = torch.randn(5, vocab, generator=g)
    others = [
        row(SP(temperature=0.0, repetition_penalty=1.3), prompt=[1, 2, 3], output=[4]),
        row(SP(temperature=1.0, top_k=7), gen=make_generator(99)),
        row(SP(**cfg)),  # same params, global RNG
        row(SP(temperature=0.5, top_p=0.3, frequency_penalty=0.4), output=[5, 5]),
        row(SP(**cfg), gen=make_generator(1234 + 1)),
    ]
    c = _draws(logits, params, seed=1234, steps=50, others=others, at=3, other_logits=other_logits)
    assert a == c

    d = _draws(logits, params, seed=4321, steps=50)
    assert a != d


def test_unseeded_rows_follow_global_rng():
    logits = torch.randn(4, 500, generator=torch.Generator().manual_seed(3))
    rows = [row(SP(temperature=1.0, top_p=0.95)) for _ in range(4)]
    torch.manual_seed(5)
    a = tokens(Sampler()(logits, rows))
    torch.manual_seed(5)
    b = tokens(Sampler()(logits, rows))
    assert a == b


# ---------------------------------------------------------------- filter sets


def _allowed(logits: torch.Tensor, p: SP) -> set[int]:
    """Independent float64 computation: temperature, top-k, top-p, min-p (vLLM order)."""
    x = logits.double() / p.temperature
    vocab = x.numel()
    order = torch.argsort(x, descending=True)
    keep = torch.zeros(vocab, dtype=torch.bool)
    k = p.top_k if 0 < p.top_k < vocab else vocab
    keep[order[:k]] = True
    if p.top_p < 1.0:
        probs = torch.softmax(x.masked_fill(~keep, -math.inf), -1)
        cum = 0.0
        nucleus = torch.zeros(vocab, dtype=torch.bool)
        for t in order.tolist():
            if not keep[t]:
                break
            nucleus[t] = True
            cum += probs[t].item()
            if cum >= p.top_p:
                break
        keep &= nucleus
    if p.min_p > 0.0:
        probs = torch.softmax(x, -1)
        keep &= probs >= p.min_p * probs.max()
    return set(torch.nonzero(keep).flatten().tolist())


FILTERS = [
    dict(top_k=1),
    dict(top_k=5),
    dict(top_k=50, temperature=0.7),
    dict(top_p=0.5),
    dict(top_p=0.9, temperature=1.5),
    dict(top_p=0.05),
    dict(min_p=0.1),
    dict(min_p=0.3, temperature=0.8),
    dict(top_k=20, top_p=0.7),
    dict(top_p=0.8, min_p=0.05),
    dict(top_k=30, top_p=0.9, min_p=0.1, temperature=1.2),
    dict(top_k=10, min_p=0.2),
]


@pytest.mark.parametrize(
    "vocab,max_rounds", [(300, 16), (300, 0), (4096, 16)], ids=["V300", "V300-sort-fallback", "V4096"]
)
@pytest.mark.parametrize("cfg", FILTERS, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_filters_never_emit_a_filtered_token(cfg, vocab, max_rounds):
    # V=4096 takes the chunked paths (two-level top-k and two-level CDF)
    g = torch.Generator().manual_seed(sum(ord(c) for c in str(sorted(cfg.items()))) + vocab)
    logits = torch.randn(vocab, generator=g) * 2.0
    params = SP(**cfg)
    allowed = _allowed(logits, params)
    assert 0 < len(allowed) < vocab
    draws = 2000
    torch.manual_seed(0)
    # 2000 draws in one call (unseeded rows) + 200 from seeded rows
    out = Sampler(max_rejection_rounds=max_rounds)(logits.expand(draws, vocab), [row(params) for _ in range(draws)])
    seeded = Sampler(max_rejection_rounds=max_rounds)(
        logits.expand(200, vocab), [row(params, gen=make_generator(i)) for i in range(200)]
    )
    got = set(tokens(out)) | set(tokens(seeded))
    assert got <= allowed, f"emitted filtered tokens {sorted(got - allowed)}"
    if len(allowed) > 1:
        assert len(got) > 1


def test_filters_per_row_in_one_batch():
    """Rows with different filters in the same batch each respect their own set."""
    g = torch.Generator().manual_seed(21)
    vocab = 200
    cfgs = FILTERS * 20
    logits = torch.randn(len(cfgs), vocab, generator=g) * 2.0
    params = [SP(**c) for c in cfgs]
    out = Sampler()(logits, [row(p, gen=make_generator(i)) for i, p in enumerate(params)])
    for i, (t, p) in enumerate(zip(out, params)):
        assert t.token_id in _allowed(logits[i], p), (i, cfgs[i])


# --------------------------------------------------------------- distributions


def _chi2(counts: torch.Tensor, probs: torch.Tensor) -> float:
    n = counts.sum().item()
    expected = probs.double() * n
    m = expected > 0
    assert counts[~m].sum() == 0
    return float((((counts[m].double() - expected[m]) ** 2) / expected[m]).sum())


def _counts(out: list[TokenLogprob], vocab: int) -> torch.Tensor:
    return torch.bincount(torch.tensor(tokens(out)), minlength=vocab)


# chi-square 99.999th percentile for 9 degrees of freedom is ~37.3
CHI2_LIMIT = 40.0


@pytest.mark.parametrize("seeded", [False, True])
def test_empirical_distribution_matches_softmax(seeded):
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, 1.5, 0.2, -2.0, 0.8])
    vocab, draws = logits.numel(), 20000
    torch.manual_seed(123)
    gens = [make_generator(10_000 + i) if seeded else None for i in range(draws)]
    out = Sampler()(logits.expand(draws, vocab), [row(SP(temperature=1.0), gen=gens[i]) for i in range(draws)])
    assert _chi2(_counts(out, vocab), torch.softmax(logits, -1)) < CHI2_LIMIT
    # the chi-square check does reject a wrong distribution
    assert _chi2(_counts(out, vocab), torch.softmax(logits / 1.3, -1)) > 10 * CHI2_LIMIT


@pytest.mark.parametrize(
    "cfg",
    [dict(top_p=0.7), dict(top_k=4), dict(top_k=6, top_p=0.8), dict(min_p=0.2), dict(top_p=0.9, min_p=0.3)],
    ids=str,
)
def test_filtered_distribution_is_renormalised(cfg):
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, 1.5, 0.2, -2.0, 0.8])
    vocab, draws = logits.numel(), 20000
    params = SP(**cfg)
    allowed = sorted(_allowed(logits, params))
    probs = torch.zeros(vocab)
    probs[allowed] = torch.softmax(logits[allowed], -1)
    torch.manual_seed(7)
    out = Sampler()(logits.expand(draws, vocab), [row(params) for _ in range(draws)])
    assert _chi2(_counts(out, vocab), probs) < CHI2_LIMIT


def test_wide_vocab_distribution_across_chunk_boundaries():
    """Wide rows are sampled with a two-level (chunked) CDF: likely tokens placed at
    chunk edges and in the last chunk must still come out at their softmax rate."""
    vocab, draws = 2048 + 37, 20000  # not a multiple of the chunk width
    logits = torch.full((vocab,), -4.0)
    hot = [0, 63, 64, 127, 128, 1000, 2047, 2048, vocab - 1]
    logits[hot] = torch.tensor([1.0, 2.0, 0.5, 1.5, -0.5, 2.5, 0.0, 1.2, 0.8])
    probs = torch.softmax(logits, -1)
    torch.manual_seed(17)
    out = Sampler()(logits.expand(draws, vocab), [row(SP(temperature=1.0)) for _ in range(draws)])
    counts = _counts(out, vocab)
    # bins: each hot token, plus everything else together
    cold = torch.ones(vocab, dtype=torch.bool)
    cold[hot] = False
    binned_counts = torch.cat([counts[hot], counts[cold].sum().view(1)])
    binned_probs = torch.cat([probs[hot], probs[cold].sum().view(1)])
    assert _chi2(binned_counts, binned_probs) < CHI2_LIMIT


@pytest.mark.parametrize("vocab", [32000, 4096, 4100, 700])
@pytest.mark.parametrize("k", [1, 5, 20, 50])
def test_chunked_topk_is_exact(vocab, k):
    g = torch.Generator().manual_seed(vocab + k)
    x = torch.randn(7, vocab, generator=g)
    x[0, :] = 0.0  # all tied
    x[1, : vocab // 2] = 5.0  # half tied at the top
    vals, ids = _topk_rows(x, k)
    ref_vals, _ = x.topk(k, dim=-1)
    assert torch.equal(vals, ref_vals)
    assert torch.equal(x.gather(1, ids), vals)
    assert all(len(set(r)) == k for r in ids.tolist())


def test_temperature_sharpens_and_flattens():
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, 1.5, 0.2, -2.0, 0.8])
    vocab, draws = logits.numel(), 20000
    top_share = {}
    for t in (0.5, 1.0, 2.0):
        torch.manual_seed(99)
        out = Sampler()(logits.expand(draws, vocab), [row(SP(temperature=t)) for _ in range(draws)])
        counts = _counts(out, vocab)
        assert _chi2(counts, torch.softmax(logits / t, -1)) < CHI2_LIMIT
        top_share[t] = counts[0].item() / draws
    assert top_share[0.5] > top_share[1.0] + 0.1 > top_share[2.0] + 0.2


# -------------------------------------------------------------------- logprobs


def test_logprobs_report_raw_distribution():
    g = torch.Generator().manual_seed(5)
    n, vocab = 6, 1000
    logits = (torch.randn(n, vocab, generator=g) * 3).to(torch.bfloat16)
    params = [
        SP(temperature=0.0, logprobs=5),
        SP(temperature=0.7, top_k=20, logprobs=1, repetition_penalty=1.5),
        SP(temperature=1.0, top_p=0.9, logprobs=20),
        SP(temperature=1.0, logprobs=None),
        SP(temperature=2.0, min_p=0.1, logprobs=0, frequency_penalty=1.0),
        SP(temperature=0.0, logprobs=3, presence_penalty=2.0),
    ]
    rows = [row(p, prompt=[1, 2, 3], output=[4, 4, 5], gen=make_generator(i)) for i, p in enumerate(params)]
    out = Sampler()(logits, rows)
    ref = torch.log_softmax(logits.float(), -1)
    for i, (t, p) in enumerate(zip(out, params)):
        if p.logprobs is None:
            assert t.logprob is None and t.top == []  # not asked: not computed
            continue
        assert t.logprob == pytest.approx(ref[i, t.token_id].item(), abs=1e-5)
        want = p.logprobs
        assert len(t.top) == want
        if want:
            vals, ids = ref[i].topk(want)
            got_lp = [lp for _, lp in t.top]
            assert got_lp == sorted(got_lp, reverse=True)
            assert got_lp == pytest.approx(vals.tolist(), abs=1e-5)
            # ids carry the logprob they are reported with (bf16 logits have ties)
            for tok, lp in t.top:
                assert lp == pytest.approx(ref[i, tok].item(), abs=1e-5)
            assert all(isinstance(tok, int) for tok, _ in t.top)
    # greedy row without penalties picks the top alternative
    assert out[0].logprob == pytest.approx(out[0].top[0][1], abs=1e-6)


def test_logprobs_are_computed_only_for_the_rows_that_ask():
    """logprobs=0 asks for the chosen token's logprob alone; None asks for nothing, and the
    row's logsumexp over the vocabulary is skipped (its logprob is None). The tokens do not
    depend on it."""
    logits = torch.randn(4, 100, generator=torch.Generator().manual_seed(8))
    asks = [None, 0, None, 0]

    def rows(logprobs):
        return [row(SP(temperature=0.0, logprobs=logprobs[0])),
                row(SP(temperature=1.0, logprobs=logprobs[1]), gen=make_generator(1)),
                row(SP(top_k=3, logprobs=logprobs[2]), gen=make_generator(2)),
                row(SP(temperature=0.0, logprobs=logprobs[3]))]

    out = Sampler()(logits, rows(asks))
    assert [t.token_id for t in out] == [t.token_id for t in Sampler()(logits, rows([0] * 4))]
    ref = torch.log_softmax(logits, -1)
    for i, t in enumerate(out):
        assert t.top == []
        if asks[i] is None:
            assert t.logprob is None
        else:
            assert t.logprob == pytest.approx(ref[i, t.token_id].item(), abs=1e-5)
            assert math.isfinite(t.logprob)


def test_logprob_ignores_penalties_and_temperature():
    """The reported logprob is of the RAW logits even when the chosen token was penalised
    or the row was sampled at a temperature."""
    logits = torch.randn(2, 1000, generator=torch.Generator().manual_seed(9))
    logits[:, 7] = 10.0
    rows = [
        # 10 / 1.5 - 2 * 0.5 - 0.5 = 5.17: still the argmax, but penalised
        row(SP(temperature=0.0, repetition_penalty=1.5, frequency_penalty=0.5, presence_penalty=0.5, logprobs=2),
            output=[7, 7]),
        row(SP(temperature=0.3, top_k=1, logprobs=1), gen=make_generator(0)),
    ]
    out = Sampler()(logits, rows)
    ref = torch.log_softmax(logits, -1)
    for i, t in enumerate(out):
        assert t.token_id == 7
        assert t.logprob == pytest.approx(ref[i, 7].item(), abs=1e-5)
        assert t.top[0] == (7, pytest.approx(ref[i, 7].item(), abs=1e-5))


def test_banned_tokens_are_never_sampled():
    logits = torch.zeros(2, 8)
    logits[:, 3] = 10.0  # the favourite
    rows = [
        SampleInput(SP(temperature=0.0), [], [], banned_token_ids=(3,)),
        SampleInput(SP(temperature=1.0, seed=1), [], [], make_generator(1), banned_token_ids=(3, 4)),
    ]
    for _ in range(50):
        out = Sampler()(logits, rows)
        assert out[0].token_id != 3 and out[1].token_id not in (3, 4)
    assert Sampler()(logits[:1], [SampleInput(SP(temperature=0.0), [], [])])[0].token_id == 3
