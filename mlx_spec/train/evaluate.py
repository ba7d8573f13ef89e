"""Evaluate a head with the real decode loop: tau, acceptance per position, speed-up.

Each held-out prompt is decoded greedily twice through `mlx_spec.stream_generate`:
plain (no drafter) and with the head at a fixed draft length k. The figures
are summed over prompts (tau = tokens per verify forward, acceptance per draft
position, generated tokens per second of each run), and `identical` records
that every speculative output equals the plain one (greedy decoding is
lossless, so anything else is a bug). A short warm-up run goes first so the
first prompt does not pay for one-time setup.
"""

from __future__ import annotations

import time

from ..decode import stream_generate
from .data import encode_chat


def _run(model, tokenizer, ids, drafter, k: int, max_tokens: int):
    t0 = time.perf_counter()
    out = list(stream_generate(model, tokenizer, ids, drafter, max_tokens=max_tokens,
                               **({"num_draft_tokens": k} if drafter is not None else {})))
    return [r.token for r in out], out[-1].stats if out else None, time.perf_counter() - t0


def evaluate(model, tokenizer, drafter, prompts: list[list[dict]], k: int = 4, max_tokens: int = 128,
             log=print) -> dict:
    """Figures of `drafter` on `prompts` (chat message lists) against plain decoding."""
    encoded = [encode_chat(tokenizer, m) for m in prompts]
    if not encoded:
        raise ValueError("no evaluation prompts")
    _run(model, tokenizer, encoded[0], drafter, k, 8)  # warm-up
    _run(model, tokenizer, encoded[0], None, k, 8)
    plain_t = spec_t = 0.0
    plain_n = spec_n = forwards = emitted = 0
    drafted_at: list[int] = []
    accepted_at: list[int] = []
    identical = True
    for i, ids in enumerate(encoded):
        base, _, dt_plain = _run(model, tokenizer, ids, None, k, max_tokens)
        toks, st, dt_spec = _run(model, tokenizer, ids, drafter, k, max_tokens)
        identical &= toks == base
        plain_t, plain_n = plain_t + dt_plain, plain_n + len(base)
        spec_t, spec_n = spec_t + dt_spec, spec_n + len(toks)
        if st is not None:
            forwards, emitted = forwards + st.target_forwards, emitted + st.step_tokens
            d, a = st.drafted_at_position, st.accepted_at_position
            drafted_at += [0] * (len(d) - len(drafted_at))
            accepted_at += [0] * (len(a) - len(accepted_at))
            for j, (x, y) in enumerate(zip(d, a)):
                drafted_at[j] += x
                accepted_at[j] += y
        log(f"eval {i + 1}/{len(encoded)}: tau so far {emitted / max(1, forwards):.2f}")
    plain_tps, spec_tps = plain_n / plain_t, spec_n / spec_t
    return {
        "k": k,
        "prompts": len(encoded),
        "max_tokens": max_tokens,
        "tau": emitted / forwards if forwards else 0.0,
        "acceptance_per_position": [a / d if d else 0.0 for a, d in zip(accepted_at, drafted_at)],
        "plain_tokens_per_second": plain_tps,
        "spec_tokens_per_second": spec_tps,
        "speedup": spec_tps / plain_tps,
        "identical_to_plain": identical,
        "note": "wall time of whole generations (prefill included), greedy, on this machine",
    }


def summary(figures: dict) -> str:
    acc = " ".join(f"{a:.2f}" for a in figures["acceptance_per_position"])
    return (f"tau {figures['tau']:.2f} at k={figures['k']} | acceptance per position {acc} | "
            f"{figures['spec_tokens_per_second']:.1f} vs {figures['plain_tokens_per_second']:.1f} tok/s plain "
            f"= {figures['speedup']:.2f}x | output identical to plain: {figures['identical_to_plain']}")
