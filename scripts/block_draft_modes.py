"""Block drafters under sampling: argmax drafts against drafts drawn from q (NumPy only).

    python scripts/block_draft_modes.py [--vocab 50] [--k 8] [--trials 40000]

A block drafter (DFlash, DSpark without a Markov head) predicts every position of
the block from the anchor alone, so its best possible q_j is the marginal of the
token j+1 steps ahead. This script builds random Markov-chain targets whose rows
have mixed sharpness (some near-deterministic, some flat), gives the drafter those
exact marginals, and counts accepted drafts per step (Monte Carlo, k drafts) when
the drafts are argmax q_j (checked as point masses) or drawn from q_j. Both are
lossless; this only measures acceptance. It backs `sample_drafts=True` as the
default (docs/dflash.md): drawn drafts accept more unless nearly every position
is near-deterministic, where argmax keeps the block on one branch.
"""

from __future__ import annotations

import argparse

import numpy as np


def accepted(P: np.ndarray, k: int, trials: int, rng) -> dict[str, float]:
    V, out = P.shape[0], {"argmax": [], "drawn from q": []}
    for y in range(V):
        q, m = [], np.eye(V)[y]
        for _ in range(k):
            m = m @ P  # marginal of the next position: what a drafter blind to d_<j can know
            q.append(m)
        n = max(trials // V, 1)
        for mode in out:
            prev, alive, count = np.full(n, y), np.ones(n, bool), np.zeros(n)
            for j in range(k):
                if mode == "argmax":
                    d = np.full(n, q[j].argmax())
                    a = P[prev, d]  # point mass: accept with p(d)
                else:
                    d = (rng.random(n)[:, None] > np.cumsum(q[j])[None]).sum(1).clip(0, V - 1)
                    a = np.minimum(1.0, P[prev, d] / q[j][d])
                alive &= rng.random(n) < a
                count += alive
                prev = d
            out[mode].append(count.mean())
    return {mode: float(np.mean(v)) for mode, v in out.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vocab", type=int, default=50)
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--trials", type=int, default=40000)
    args = ap.parse_args()
    print(f"accepted drafts per step, k={args.k}, vocabulary {args.vocab}")
    print("target's mean top-1 p | argmax | drawn from q")
    for mu in (0.5, 1.5, 2.0, 2.5, 3.5):
        rng = np.random.default_rng(0)
        sharp = np.exp(rng.normal(mu, 1.0, size=(args.vocab, 1)))
        logits = rng.normal(size=(args.vocab, args.vocab)) * sharp
        P = np.exp(logits - logits.max(1, keepdims=True))
        P /= P.sum(1, keepdims=True)
        got = accepted(P, args.k, args.trials, rng)
        print(f"{P.max(1).mean():21.2f} | {got['argmax']:6.2f} | {got['drawn from q']:12.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
