"""The sampled-losslessness harness: exact laws by enumeration, seeded runs, checks, wrong rules.

On a tiny vocabulary (V = 8) the exact joint law of the first P generated tokens
under plain sampling is computable by enumerating every prefix the target can
produce: one batched target forward per position, and the next-token
distribution taken from `np_sampler` (float64 NumPy, independent of the code
under test). Seeded runs through `mlx_spec.stream_generate` with `trace=True`
feed both the checks (per-position marginals and the joint law of neighbouring
positions, chi-square) and the guards that the run really drafted deep blocks
and accepted and rejected at depth.

Power: `wrong_rule(...)` builds a deliberately broken `rejection_accept`;
patched into `mlx_spec.acceptance` (the dispatcher `accept` looks it up as a
module global) it must make the same check fail.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

import mlx_spec
import mlx_spec.acceptance
import np_sampler
import tiny
from stats_utils import chi2_pvalue

ALPHA = 1e-4  # a correct rule must pass every check at this level, a wrong one fail one


# ---- targets --------------------------------------------------------------------------------


def v8_llama(sharpen=2.0, dtype=None, **kw):
    """A 1-layer tiny llama over 8 tokens. With another `sharpen` the same network with a
    rescaled LM head (the target at another temperature): a draft close to it, not equal."""
    model = tiny.llama_model(seed=3, vocab=8, sharpen=sharpen, layers=1, **kw)
    if dtype is not None:
        model.set_dtype(dtype)
        mx.eval(model.parameters())
    return model


def v8_successor_llama(gain=0.45):
    """A target that mostly continues 0 1 2 .. 7 0 1 .. (its LM head row v is the
    embedding of v - 1, p ~ 0.6 for the successor), so prompt lookup on such a prompt
    is often right."""
    model = v8_llama()
    E = model.model.embed_tokens.weight
    model.lm_head.weight = E[(mx.arange(8) - 1) % 8] * gain
    mlp = model.model.layers[0].mlp
    mlp.down_proj.weight = mlp.down_proj.weight * 0.3
    mx.eval(model.parameters())
    return model


# ---- the exact law ------------------------------------------------------------------------


def next_token_probs(model, prompt, prefixes, sampling: dict, make_cache=None, chunk=2048):
    """np_sampler's distribution after prompt + each prefix: [len(prefixes), V] float64."""
    out = []
    for i in range(0, len(prefixes), chunk):
        batch = mx.array([list(prompt) + [int(t) for t in s] for s in prefixes[i : i + chunk]])
        cache = None if make_cache is None else make_cache()
        logits = model(batch, cache=cache)[:, -1].astype(mx.float32)
        out.append(np_sampler.probs(np.array(logits, np.float64), **sampling))
    return np.concatenate(out)


def exact_joint(model, prompt, positions: int, sampling: dict, *, vocab: int, eos=None,
                make_cache=None) -> np.ndarray:
    """Joint law of the first `positions` tokens of plain sampling, shape [C] * positions.

    C = vocab, or vocab + 1 with `eos`: a sequence stops after its first EOS, and
    the extra symbol `vocab` marks the positions after the stop. `make_cache`
    builds the cache the enumeration runs the target with (e.g. a quantized one).
    """
    C = vocab + (eos is not None)
    joint = np.ones(1)
    for pos in range(positions):
        prefixes = np.stack(np.unravel_index(np.arange(C**pos), (C,) * pos), -1) if pos else \
            np.zeros((1, 0), int)
        ended = np.zeros(len(prefixes), bool)
        if eos is not None:
            ended = ((prefixes == eos) | (prefixes == vocab)).any(1)
        live = (joint > 0) & ~ended
        new = np.zeros((len(prefixes), C))
        if live.any():
            rows = next_token_probs(model, prompt, prefixes[live], sampling, make_cache)
            new[live, :vocab] = joint[live, None] * rows[:, :vocab]
        if eos is not None:
            new[ended, vocab] = joint[ended]
        joint = new.ravel()
    return joint.reshape((C,) * positions)


# ---- seeded runs ----------------------------------------------------------------------------


@dataclass
class Runs:
    tokens: np.ndarray  # [runs, max_tokens]; `vocab` after a stop
    traces: list  # per run: the StepTrace list
    finish: list  # per run: the last response's finish_reason
    vocab: int
    proposals: list = field(default_factory=list)  # per run: the Drafts proposed (when recorded)


def sampled_runs(model, prompt, make_drafter, runs: int, *, max_tokens: int, k, vocab: int,
                 eos=None, make_cache=None, seed0: int = 0, record_drafts=False, **sampling) -> Runs:
    """`runs` seeded `stream_generate` calls (seeds seed0, seed0 + 1, ...), traced.

    `make_drafter()` is called once per run (a drafter object may be shared when the
    runs do not overlap, as here). With `record_drafts` each proposed `Draft` is kept.
    """
    tok = tiny.tokenizer(vocab=vocab, eos=eos)
    tokens = np.full((runs, max_tokens), vocab)
    traces, finish, proposals = [], [], []
    for r in range(runs):
        drafter = make_drafter()
        seen = []
        if record_drafts:
            drafter = _Recording(drafter, seen)
        out = list(mlx_spec.stream_generate(
            model, tok, prompt, drafter, max_tokens=max_tokens, num_draft_tokens=k,
            seed=seed0 + r, trace=True, prompt_cache=None if make_cache is None else make_cache(),
            **sampling))
        tokens[r, : len(out)] = [o.token for o in out]
        traces.append(out[-1].stats.trace or [])
        finish.append(out[-1].finish_reason)
        proposals.append(seen)
    return Runs(tokens, traces, finish, vocab, proposals)


class _Recording:
    """A drafter that records its proposals and otherwise is the drafter it wraps."""

    def __init__(self, inner, seen: list):
        self._inner, self._seen = inner, seen

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def propose(self, y, k, sampling):
        draft = self._inner.propose(y, k, sampling)
        self._seen.append(draft)
        return draft


# ---- the checks ---------------------------------------------------------------------------


def law_pvalues(runs: Runs, joint: np.ndarray, positions=None, pairs=None) -> dict[str, float]:
    """Chi-square p-values: marginals of `positions` (default 1..P-1; position 0 is
    the prefill's own sample) and joints of `pairs` (default every neighbouring pair
    from (1, 2))."""
    P, C = joint.ndim, joint.shape[0]
    positions = range(1, P) if positions is None else positions
    pairs = [(j, j + 1) for j in range(1, P - 1)] if pairs is None else pairs
    out = {}
    for j in positions:
        law = joint.sum(axis=tuple(a for a in range(P) if a != j))
        out[f"position {j}"] = chi2_pvalue(np.bincount(runs.tokens[:, j], minlength=C), law)
    for i, j in pairs:
        law = joint.sum(axis=tuple(a for a in range(P) if a not in (i, j))).ravel()
        cells = runs.tokens[:, i] * C + runs.tokens[:, j]
        out[f"pair {i},{j}"] = chi2_pvalue(np.bincount(cells, minlength=C * C), law)
    return out


def assert_lossless(runs: Runs, joint: np.ndarray, **kw) -> dict[str, float]:
    p = law_pvalues(runs, joint, **kw)
    print(f"lossless check over {len(runs.traces)} runs: smallest p {min(p.values()):.3g}")
    bad = {name: v for name, v in p.items() if not v > ALPHA}
    assert not bad, f"sampled law differs from the target's: {bad} (all: {p})"
    return p


def assert_caught(runs: Runs, joint: np.ndarray, **kw) -> dict[str, float]:
    """The wrong rule must fail at least one of the checks."""
    p = law_pvalues(runs, joint, **kw)
    print(f"wrong rule over {len(runs.traces)} runs: smallest p {min(p.values()):.3g}")
    assert min(p.values()) < ALPHA, f"the check missed a wrong rule: {p}"
    return p


@dataclass
class Depth:
    """What the verify steps of a set of runs did, by draft depth i (0-based)."""

    drafted: Counter  # drafts verified at depth i
    accepted: Counter  # ... of which accepted
    rejected: Counter  # steps whose first rejection was at depth i
    full: Counter  # steps that accepted all of their L verified drafts, by L (bonus after L)
    first: Counter  # verified drafts in each run's first step

    def at_least(self, i: int, counter: Counter) -> int:
        return sum(v for d, v in counter.items() if d >= i)


def depth(runs: Runs) -> Depth:
    d = Depth(Counter(), Counter(), Counter(), Counter(), Counter())
    for trace in runs.traces:
        if trace:
            d.first[len(trace[0].proposed)] += 1
        for t in trace:
            L, n = len(t.proposed), t.accepted
            for i in range(L):
                d.drafted[i] += 1
                d.accepted[i] += i < n
            if n < L:
                d.rejected[n] += 1
            else:
                d.full[L] += 1
    return d


def assert_deep(runs: Runs, first_k: int = 3, share: float = 0.9, events: int = 100) -> Depth:
    """The runs exercised deep blocks: most first steps verify >= `first_k` drafts, and
    drafts at depth >= 1 (the second and later) are accepted and rejected, and blocks of
    >= 2 drafts are accepted whole (a bonus after them), each at least `events` times."""
    d = depth(runs)
    n_runs = len(runs.traces)
    assert d.at_least(first_k, d.first) >= share * n_runs, f"first steps: {dict(d.first)}"
    deep_acc = d.at_least(1, d.accepted)
    deep_rej = d.at_least(1, d.rejected)
    deep_full = d.at_least(2, d.full)
    assert min(deep_acc, deep_rej, deep_full) >= events, (
        f"depth >= 1: {deep_acc} accepted, {deep_rej} first rejections; "
        f"{deep_full} whole blocks of >= 2 ({dict(d.full)})")
    return d


# ---- deliberately wrong acceptance rules ----------------------------------------------------


def wrong_rule(residual="max", bonus_row=0, use_q=True, cut="p", fallback="row"):
    """A `rejection_accept` with one deliberate error (the defaults are the right rule):

    * residual="p": after a rejection, draw from p_i instead of max(p_i - q_i, 0)
      (for a point mass: instead of p_i without d_i);
    * bonus_row=-1: after k accepted drafts, draw the bonus from p_(k-1), not p_k;
    * use_q=False: accept d_i with probability min(1, p_i(d_i)), ignoring q_i(d_i);
    * cut="residual": with a `length` L < k, at n = L draw from the residual of
      row L (as if d_L had been rejected) instead of from p_L;
    * fallback="first" / None: a residual with no mass falls back to p_0 instead of
      p_n / is drawn from as it is (mx.random.categorical then returns token 0).
    """

    def rule(p, q, draft, length=None):
        k = draft.shape[0]
        if k == 0:
            return mx.array(0), mx.random.categorical(mx.log(p[0]))
        rows = mx.arange(k)
        p_d = p[rows, draft]
        if q is None:
            q_d, res = mx.ones_like(p_d), p[:k] * (mx.arange(p.shape[-1])[None] != draft[:, None])
        else:
            q_d, res = q[rows, draft], mx.maximum(p[:k] - q, 0)
        if residual == "p":
            res = p[:k]
        if not use_q:
            q_d = mx.ones_like(p_d)
        accepted = mx.random.uniform(shape=(k,)) * q_d < p_d
        if length is not None:
            accepted = accepted & (rows < length)
        n = mx.cumprod(accepted).sum()
        row = mx.concatenate([res, p[k + bonus_row][None]])[n]
        if length is not None:
            at_cut = p[n] if cut == "p" else mx.concatenate([res, p[k:]])[n]
            row = mx.where(n >= length, at_cut, row)
        if fallback is not None:
            row = mx.where(row.sum() > 0, row, p[n] if fallback == "row" else p[0])
        return n, mx.random.categorical(mx.log(row))

    return rule


def use_rule(monkeypatch, rule) -> None:
    monkeypatch.setattr(mlx_spec.acceptance, "rejection_accept", rule)
