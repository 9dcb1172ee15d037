"""Turn one decode step's logits into one token per request.

Order of processing follows vLLM:

1. logprobs are reported from the *raw* logits (log-softmax in fp32);
2. penalties: repetition (prompt + output tokens, divide positive logits / multiply
   negative ones), then presence and frequency (output tokens only);
3. greedy rows (temperature == 0): argmax of the penalised logits (first index on ties);
4. the other rows: divide by temperature, then top-k, top-p (relative to the top-k
   distribution), min-p (relative to the most likely token), then sample.

Sampling draws ONE uniform number per row from the row's own ``torch.Generator``
(inverse-CDF sampling), so a seeded request's tokens depend only on its own logits and
seed, never on what else is in the batch. Rows without a generator use the global RNG.

Efficiency (CPU, batch up to a few hundred, vocab ~32k): work no row needs is skipped
(no penalties -> no penalty pass; all greedy -> one argmax; no top-logprobs -> no
top-k over the raw logits). Nothing sorts the vocabulary on the common path:

* top-k rows are reduced to their ``topk(k)`` candidates (rows grouped by k) and
  top-p / min-p / sampling happen on that small [rows, k] tensor;
* top-p without top-k uses exact rejection sampling: sample from the (min-p filtered)
  distribution, accept the token if the probability mass strictly above it is below
  ``top_p``; otherwise resample among strictly more likely tokens only. Every
  rejected token's level and all below it are discarded, so this converges in a round
  or two for real distributions (a sort is the fallback after ``max_rejection_rounds``).
  Accepted tokens are distributed exactly as the renormalised nucleus distribution.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from cluster.engine.outputs import TokenLogprob
from cluster.engine.sampling_params import SamplingParams

__all__ = ["SampleInput", "Sampler", "make_generator"]


@dataclass
class SampleInput:
    """One row to sample, in batch order."""

    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    # Per-request generator, seeded from params.seed by the caller; None = global RNG.
    generator: torch.Generator | None = None
    # Tokens this row must not produce now (eos and stop tokens before min_tokens, as vLLM).
    banned_token_ids: Sequence[int] = ()
    # The only tokens a constrained row may produce ([vocab] bool; None: any). Where the
    # grammar allows nothing but banned tokens (its end, before min_tokens), it wins.
    allowed: torch.Tensor | None = None


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator | None:
    """The per-request generator a caller keeps for a request (None when unseeded)."""
    if seed is None:
        return None
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    return g


def _below(v: float) -> float:
    """The largest float32 strictly below v (so `x > _below(v)` means `x >= v` in fp32)."""
    return float(np.nextafter(np.float32(v), np.float32(-np.inf)))


def _take_rows(t: torch.Tensor, idx: list[int]) -> torch.Tensor:
    """t[idx] along dim 0 without a copy when idx is every row (idx is sorted, unique)."""
    if len(idx) == t.shape[0]:
        return t
    return t.index_select(0, torch.tensor(idx, device=t.device))


def _argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """First index of the maximum of each row. numpy's SIMD argmax is >10x faster than
    torch's on CPU; same first-occurrence tie rule."""
    if x.device.type == "cpu":
        return torch.from_numpy(x.detach().numpy().argmax(axis=1))
    return x.argmax(dim=-1)


def _topk_rows(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, indices) of the k largest entries per row, most likely first.

    For small k, a two-level search is several times faster than torch.topk on CPU:
    the k largest entries lie in the k chunks with the largest chunk maxima (a chunk
    holding one of them has a maximum >= the k-th value, and at most k chunks do), so
    take chunk maxima, the top-k chunks, and topk over their k*C entries only. Values
    are exact; among exactly tied entries at the k-th place either may be chosen (the
    choice depends only on the row)."""
    rows, vocab = x.shape
    chunk = 64 if k * 64 * 8 <= vocab else 32
    if k * chunk * 8 > vocab or vocab % chunk or rows == 0:
        return x.topk(k, dim=-1)
    xc = x.view(rows, vocab // chunk, chunk)
    _, ci = xc.amax(dim=-1).topk(k, dim=-1, sorted=False)  # [R, k] chunk ids
    cand = xc.gather(1, ci.unsqueeze(-1).expand(rows, k, chunk)).reshape(rows, k * chunk)
    vals, pos = cand.topk(k, dim=-1)
    ids = (ci.unsqueeze(-1) * chunk + torch.arange(chunk, device=x.device)).reshape(rows, k * chunk)
    return vals, ids.gather(1, pos)


def _logsumexp_rows(x: torch.Tensor, block: int = 16) -> torch.Tensor:
    """logsumexp over the last dim; ~1.5-2x faster than torch.logsumexp on CPU. Works in
    blocks of rows so the exp temporary stays in cache instead of a fresh [N, V] buffer."""
    if x.shape[0] > block:
        return torch.cat([_logsumexp_rows(x[i : i + block], block) for i in range(0, x.shape[0], block)])
    m = x.amax(dim=-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))  # all -inf rows -> -inf
    return (x - m).exp_().sum(dim=-1).log_().add_(m.squeeze(-1))


def _first_above(cum: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Per row, the first index i with cum[i] > target (cum non-decreasing, last > 0).
    target is clamped just below the row total first, so i always exists and
    cum[i] > cum[i-1], i.e. the chosen entry has non-zero weight."""
    total = cum[:, -1]
    target = torch.minimum(target.clamp_min(0.0), torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cum, target.unsqueeze(1), right=True).squeeze(1)


_CDF_CHUNK = 64
_ROW_BLOCK = 16  # rows per block for full-vocabulary temporaries


def _cdf_sample(w: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Sample one column per row of the non-negative weights w [R, M] (row sums > 0)
    with inverse-CDF sampling driven by u [R] ~ U[0, 1) (float64). Zero-weight columns
    are never returned; every op works per row, so a row's result does not depend on
    the other rows.

    Wide rows use a two-level CDF (a full-width cumsum is the slowest op on CPU): chunk
    sums -> cumsum over chunks -> pick a chunk -> cumsum inside that chunk only."""
    rows, m = w.shape
    u = u.to(torch.float64)
    if m < 8 * _CDF_CHUNK:
        cum = w.cumsum(-1)
        return _first_above(cum, (u * cum[:, -1].to(torch.float64)).to(torch.float32))
    pad = (-m) % _CDF_CHUNK
    if pad:
        w = F.pad(w, (0, pad))  # zero weight, never chosen
    wc = w.view(rows, -1, _CDF_CHUNK)
    ccum = wc.sum(dim=-1).cumsum(dim=-1)  # [R, chunks]
    target = u * ccum[:, -1].to(torch.float64)
    ci = _first_above(ccum, target.to(torch.float32))  # chunk holding the target
    before = torch.where(ci > 0, ccum.gather(1, (ci - 1).clamp_min(0).unsqueeze(1)).squeeze(1), 0.0)
    rest = (target - before.to(torch.float64)).to(torch.float32)
    inner = wc.gather(1, ci.view(rows, 1, 1).expand(rows, 1, _CDF_CHUNK)).squeeze(1).cumsum(-1)
    return ci * _CDF_CHUNK + _first_above(inner, rest)


class Sampler:
    """Stateless; one instance can serve every step of an engine."""

    def __init__(self, max_rejection_rounds: int = 16) -> None:
        self.max_rejection_rounds = max_rejection_rounds

    # ------------------------------------------------------------------ public
    def __call__(self, logits: torch.Tensor, rows: Sequence[SampleInput]) -> list[TokenLogprob]:
        n = len(rows)
        if logits.dim() != 2 or logits.shape[0] != n:
            raise ValueError(f"logits must be [len(rows)={n}, vocab], got {tuple(logits.shape)}")
        if n == 0:
            return []
        raw = logits.to(torch.float32)  # no copy when already fp32; never modified in place
        if not raw.is_contiguous():
            raw = raw.contiguous()
        device = raw.device

        # (2) penalties -> `work` (== raw when no row uses any); tokens a grammar refuses and
        # banned tokens -> -inf
        work = self._apply_penalties(raw, rows)
        constrained = [i for i, r in enumerate(rows) if r.allowed is not None]
        if constrained:
            allowed = torch.stack([rows[i].allowed for i in constrained]).to(device)
            minus_inf = torch.tensor(float("-inf"), device=device)
            if len(constrained) == n:  # a new tensor in one pass: no clone of raw first
                work = torch.where(allowed, work, minus_inf)
            else:
                work = work.clone() if work is raw else work
                idx = torch.tensor(constrained, device=device)
                work.index_copy_(0, idx, torch.where(allowed, work.index_select(0, idx), minus_inf))
        banned = [(i, r.banned_token_ids) for i, r in enumerate(rows) if r.banned_token_ids]
        if banned:
            work = work.clone() if work is raw else work
            for i, ids in banned:
                ids = torch.tensor(sorted(set(ids)), dtype=torch.long, device=device)
                allowed = rows[i].allowed
                if allowed is not None and int(allowed.sum()) == int(allowed[ids.cpu()].sum()):
                    continue  # the grammar allows only banned tokens: it wins
                work[i, ids] = float("-inf")

        tokens = torch.empty(n, dtype=torch.long, device=device)
        greedy = [i for i, r in enumerate(rows) if r.params.temperature == 0.0]
        random = [i for i, r in enumerate(rows) if r.params.temperature != 0.0]
        # (3) greedy: first maximal index, like torch.argmax / HF transformers
        if greedy:
            g_tok = _argmax_rows(_take_rows(work, greedy)).to(device)
            if len(greedy) == n:
                tokens = g_tok
            else:
                tokens[torch.tensor(greedy, device=device)] = g_tok
        # (4) random sampling
        if random:
            r_tok = self._sample(work, random, [rows[i] for i in random])
            if len(random) == n:
                tokens = r_tok
            else:
                tokens[torch.tensor(random, device=device)] = r_tok

        # (1) logprobs of the raw logits, for the rows that asked (logprobs 0: the chosen
        # token's only): logit - logsumexp, computed without a full log_softmax; top
        # alternatives come from topk of the raw logits.
        chosen_lp: dict[int, float] = {}
        top: dict[int, list[tuple[int, float]]] = {}
        asked = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
        if asked:
            asked_raw = _take_rows(raw, asked)
            lse = _logsumexp_rows(asked_raw)
            asked_tokens = _take_rows(tokens.unsqueeze(1), asked)
            chosen_lp = dict(zip(asked, (asked_raw.gather(1, asked_tokens).squeeze(1) - lse).tolist()))
            want = [j for j, i in enumerate(asked) if rows[i].params.logprobs]
            if want:
                k = min(max(rows[asked[j]].params.logprobs for j in want), raw.shape[1])
                vals, ids = _topk_rows(_take_rows(asked_raw, want), k)
                vals = vals - _take_rows(lse.unsqueeze(1), want)
                for j, v_row, id_row in zip(want, vals.tolist(), ids.tolist()):
                    m = rows[asked[j]].params.logprobs
                    top[asked[j]] = list(zip(id_row[:m], v_row[:m]))

        return [TokenLogprob(token_id=t, logprob=chosen_lp.get(i), top=top.get(i, [])) for i, t in enumerate(tokens.tolist())]

    # --------------------------------------------------------------- penalties
    @staticmethod
    def _apply_penalties(raw: torch.Tensor, rows: Sequence[SampleInput]) -> torch.Tensor:
        """Return logits with penalties applied (raw itself when no row has any).

        Works sparsely on the (row, token) pairs that occur, never on a dense
        [rows, vocab] count table: repetition and presence are gather -> put (duplicate
        indices write the same value, so each token is penalised once), frequency is
        an index_add (each occurrence subtracts once)."""
        pen = [
            i
            for i, r in enumerate(rows)
            if r.params.repetition_penalty != 1.0
            or r.params.presence_penalty != 0.0
            or r.params.frequency_penalty != 0.0
        ]
        if not pen:
            return raw
        vocab = raw.shape[1]
        device = raw.device

        def as_ids(seq: Sequence[int] | torch.Tensor | np.ndarray) -> np.ndarray:
            if isinstance(seq, torch.Tensor):
                a = seq.detach().cpu().numpy().astype(np.int64, copy=False).reshape(-1)
            else:
                a = np.asarray(seq, dtype=np.int64).reshape(-1)  # much faster than torch.as_tensor(list)
            if a.size and (a.min() < 0 or a.max() >= vocab):
                raise ValueError(f"token id out of range [0, {vocab})")
            return a

        # flat indices (row * vocab + token) and the per-index penalty value
        rep_idx: list[np.ndarray] = []
        rep_val: list[np.ndarray] = []
        pres_idx: list[np.ndarray] = []
        pres_val: list[np.ndarray] = []
        freq_idx: list[np.ndarray] = []
        freq_val: list[np.ndarray] = []
        for i in pen:
            p = rows[i].params
            out = as_ids(rows[i].output_token_ids) + i * vocab
            if p.repetition_penalty != 1.0:
                ids = np.concatenate([as_ids(rows[i].prompt_token_ids) + i * vocab, out])
                rep_idx.append(ids)
                rep_val.append(np.full(ids.size, p.repetition_penalty, dtype=np.float32))
            if p.presence_penalty != 0.0 and out.size:
                pres_idx.append(out)
                pres_val.append(np.full(out.size, p.presence_penalty, dtype=np.float32))
            if p.frequency_penalty != 0.0 and out.size:
                freq_idx.append(out)
                freq_val.append(np.full(out.size, p.frequency_penalty, dtype=np.float32))

        def cat(parts: list[np.ndarray]) -> torch.Tensor:
            return torch.from_numpy(np.concatenate(parts)).to(device)

        work = raw.clone()
        flat = work.view(-1)
        if rep_idx:
            idx, pv = cat(rep_idx), cat(rep_val)
            v = flat[idx]
            flat[idx] = torch.where(v > 0, v / pv, v * pv)
        if pres_idx:
            idx = cat(pres_idx)
            flat[idx] = flat[idx] - cat(pres_val)
        if freq_idx:
            flat.index_add_(0, cat(freq_idx), cat(freq_val), alpha=-1.0)
        # A repetition penalty near 0 divides a positive logit into +inf; two of them would
        # make inf - inf = NaN weights. Kept finite, they are the most likely tokens, tied.
        return work.clamp_(max=torch.finfo(work.dtype).max)

    # ---------------------------------------------------------------- sampling
    @staticmethod
    def _uniform(gen: torch.Generator | None, device: torch.device) -> torch.Tensor:
        if gen is None:
            return torch.rand(1, dtype=torch.float64, device=device)
        return torch.rand(1, dtype=torch.float64, generator=gen, device=gen.device).to(device)

    def _uniforms(self, rows: Sequence[SampleInput], device: torch.device) -> torch.Tensor:
        """One U[0,1) per row: seeded rows from their own generator, the rest in one call."""
        u = torch.empty(len(rows), dtype=torch.float64, device=device)
        plain = [j for j, r in enumerate(rows) if r.generator is None]
        if plain:
            u[torch.tensor(plain, device=device)] = torch.rand(len(plain), dtype=torch.float64, device=device)
        for j, r in enumerate(rows):
            if r.generator is not None:
                u[j] = self._uniform(r.generator, device)[0]
        return u

    def _sample(self, work: torch.Tensor, where: list[int], rows: Sequence[SampleInput]) -> torch.Tensor:
        """Rows `where` of the penalised logits `work` (all with temperature > 0; `rows`
        are their inputs, in the same order) -> their token ids."""
        r_count = len(rows)
        vocab = work.shape[1]
        device = work.device
        params = [r.params for r in rows]

        # Temperature is folded into the exp of (logit - max): filters only compare and
        # sum probabilities, so x / T is never materialised (top-k order ignores T).
        inv_t = [1.0 / p.temperature for p in params]

        u = self._uniforms(rows, device)
        out = torch.empty(r_count, dtype=torch.long, device=device)

        by_k: dict[int, list[int]] = {}
        full: list[int] = []
        for j, p in enumerate(params):
            if 0 < p.top_k < vocab:
                by_k.setdefault(p.top_k, []).append(j)
            else:
                full.append(j)

        # ---- rows with top-k: everything happens on their k candidates
        for k, idx in by_k.items():
            xs = _take_rows(work, [where[j] for j in idx])
            vals, ids = _topk_rows(xs, k)  # sorted, most likely first
            w = vals - vals[:, :1]
            ps = [params[j] for j in idx]
            if any(inv_t[j] != 1.0 for j in idx):
                w.mul_(torch.tensor([inv_t[j] for j in idx], device=device).unsqueeze(1))
            w.exp_()  # p / p_max at temperature T; w[:, 0] == 1
            if any(p.top_p < 1.0 for p in ps):
                tp = torch.tensor([p.top_p if p.top_p < 1.0 else math.inf for p in ps], device=device)
                cum = w.cumsum(-1)
                keep = (cum - w) < tp.unsqueeze(1) * cum[:, -1:]
                w = w * keep
            if any(p.min_p > 0.0 for p in ps):
                mp = torch.tensor([p.min_p for p in ps], dtype=torch.float32, device=device)
                w = w * (w >= mp.unsqueeze(1))
            pos = _cdf_sample(w, _take_rows(u.unsqueeze(1), idx).squeeze(1))
            tok = ids.gather(1, pos.unsqueeze(1)).squeeze(1)
            if len(idx) == r_count:
                out = tok
            else:
                out[torch.tensor(idx, device=device)] = tok

        if not full:
            return out

        # ---- rows without top-k: full vocabulary, in blocks of rows so that the
        # [rows, V] temporaries stay in cache
        for b in range(0, len(full), _ROW_BLOCK):
            blk = full[b : b + _ROW_BLOCK]
            pos = self._sample_full(
                _take_rows(work, [where[j] for j in blk]),
                [params[j] for j in blk],
                [inv_t[j] for j in blk],
                _take_rows(u.unsqueeze(1), blk).squeeze(1),
                [rows[j].generator for j in blk],
            )
            if len(blk) == r_count:
                return pos
            out[torch.tensor(blk, device=device)] = pos
        return out

    def _sample_full(
        self,
        x: torch.Tensor,
        ps: list[SamplingParams],
        inv_t: list[float],
        u: torch.Tensor,
        gens: list[torch.Generator | None],
    ) -> torch.Tensor:
        """Rows without top-k: temperature, top-p (by rejection), min-p, sample."""
        device = x.device
        w = x - x.amax(dim=-1, keepdim=True)
        if any(t != 1.0 for t in inv_t):
            w.mul_(torch.tensor(inv_t, device=device).unsqueeze(1))
        w.exp_()  # p / p_max at temperature T, max == 1
        topp = [jj for jj, p in enumerate(ps) if p.top_p < 1.0]
        minp = [jj for jj, p in enumerate(ps) if p.min_p > 0.0]
        ws = w  # sampling weights: w with min-p applied
        if minp:
            if topp:
                ws = w.clone()  # top-p mass is measured on the distribution before min-p
            for jj in minp:
                F.threshold(ws[jj], _below(ps[jj].min_p), 0.0, inplace=True)
        pos = _cdf_sample(ws, u)
        if not topp:
            return pos
        totals = _take_rows(w, topp).sum(dim=-1).tolist()
        pos_list = pos.tolist()
        for jj, total in zip(topp, totals):
            pos_list[jj] = self._nucleus_reject(w[jj], ws[jj], pos_list[jj], ps[jj].top_p * total, gens[jj])
        return torch.tensor(pos_list, dtype=torch.long, device=device)

    def _nucleus_reject(
        self,
        w: torch.Tensor,
        ws: torch.Tensor,
        pos: int,
        limit: float,
        gen: torch.Generator | None,
    ) -> int:
        """Top-p for one row by rejection. w: [V] p/p_max before min-p; ws: after min-p;
        pos: a token sampled from ws; limit: top_p * sum(w). A token is in the nucleus iff
        the mass strictly above it is < limit (ties enter or leave together)."""
        device = w.device
        for _ in range(self.max_rejection_rounds):
            wj = float(w[pos])
            if float(F.threshold(w, wj, 0.0).sum()) < limit:
                return pos
            # Rejected: so is every token not more likely than it. Resample among the rest
            # (the most likely token is always in the nucleus, so the rest is non-empty).
            pos = int(_cdf_sample(F.threshold(ws, wj, 0.0).unsqueeze(0), self._uniform(gen, device))[0])
        wj = float(w[pos])
        if float(F.threshold(w, wj, 0.0).sum()) < limit:
            return pos
        # Fallback: exact nucleus by sorting (rare: many rejections in a row).
        sw, order = w.sort(descending=True, stable=True)
        cum = sw.cumsum(0)
        keep = (cum - sw) < limit
        sws = ws[order] * keep
        p = int(_cdf_sample(sws.unsqueeze(0), self._uniform(gen, device))[0])
        return int(order[p])
