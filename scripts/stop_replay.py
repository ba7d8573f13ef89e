"""What ending draft chains at an unsure token would gain, replayed on the target's own text.

    python scripts/stop_replay.py [--model qwen2.5-coder-1.5b-instruct]
        [--draft-model qwen2.5-coder-0.5b-instruct] [--prompts-per-suite 2] [--max-tokens 40]
        [--thresholds 0,0.3,0.4,0.5,0.6] [--lengths 4,6,8,12,16]

For each bench prompt: the target's greedy text (mlx-lm's `generate_step`), then in one
forward the draft model's argmax and its probability at every position of that text
(teacher-forced: what a chain sees while it is being accepted). A greedy run is replayed
with a fixed draft length k: a step drafts up to k tokens, ending after the first token whose
probability is below the threshold (`DraftModelDrafter(min_confidence=...)`; 0: never), the
target keeps the drafts up to the first disagreement and one token more. A step costs the
forwards `auto` itself weighs (`mlx_spec.calibration.verify_seconds`, measured once per model
and device and cached; `--recalibrate` measures again): the draft's one-token forward per
drafted token and the target's forward over the drafted tokens + 1. Printed: the replayed speed-up over plain decoding (the target's one-token forward a
token) for every threshold and k, pooled and per suite at the best k. An estimate: the draft
past a rejection sees the target's text, not its own, and `auto` picks k per step.

Other rules, replayed on the same text (what they would gain before anyone builds them):
`--products 0.3,0.5` end a chain where the product of its probabilities falls below the value;
`--fork` also verifies, beside the unsure token that ended a chain, the draft's runner-up
there (one more verified row, no more draft forwards: a two-branch tree at the stop); and
the last line, `oracle`, ends every chain exactly at its first token the target rejects,
the ceiling no rule that reads only the draft's probabilities can pass.
"""

from __future__ import annotations

import argparse
import math
import sys


def main() -> int:
    from mlx_spec.fastblas import restart_with_fast_blas

    restart_with_fast_blas()
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    p.add_argument("--draft-model", default="qwen2.5-coder-0.5b-instruct")
    p.add_argument("--prompts-per-suite", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=40)
    p.add_argument("--thresholds", default="0,0.3,0.4,0.5,0.6")
    p.add_argument("--lengths", default="4,6,8,12,16")
    p.add_argument("--products", default="", help="thresholds on the chain's product of probabilities")
    p.add_argument("--fork", action="store_true", help="also replay the runner-up beside each unsure token")
    p.add_argument("--recalibrate", action="store_true", help="measure both models' forward costs again")
    args = p.parse_args()
    thresholds = [float(t) for t in args.thresholds.split(",")]
    products = [float(t) for t in args.products.split(",") if t]

    import mlx.core as mx
    from mlx_lm.generate import generate_step

    import mlx_spec
    from mlx_spec.bench.suites import SUITE_ORDER as SUITES, encode_chat, load_suite
    from mlx_spec.calibration import verify_seconds
    from mlx_spec.generate_cli import resolve_model

    target, tok = mlx_spec.load(resolve_model(args.model))
    draft, _ = mlx_spec.load(resolve_model(args.draft_model))
    lengths = [int(k) for k in args.lengths.split(",")]
    texts = []  # (suite, draft argmax == target token, its probability, runner-up == target token)
    for suite in SUITES:
        for prompt in load_suite(suite)[: args.prompts_per_suite]:
            ids = encode_chat(tok, prompt.text)
            out = []
            for t, _ in generate_step(mx.array(ids), target, max_tokens=args.max_tokens):
                out.append(int(t))
                if out[-1] in tok.eos_token_ids:
                    break
            logits = draft(mx.array(ids + out)[None])[0, len(ids) - 1 : -1].astype(mx.float32)
            sure = mx.exp(mx.max(logits, axis=-1) - mx.logsumexp(logits, axis=-1)).tolist()
            top2 = mx.argpartition(-logits, kth=1, axis=-1)[:, :2]
            top2 = mx.take_along_axis(top2, mx.argsort(-mx.take_along_axis(logits, top2, axis=-1), axis=-1), axis=-1)
            agree = [a == t for a, t in zip(top2[:, 0].tolist(), out)]
            second = [a == t for a, t in zip(top2[:, 1].tolist(), out)]
            texts.append((suite, agree, sure, second))
    curve = [1000 * t for t in verify_seconds(target, recalibrate=args.recalibrate)]  # ms, n = 1..17
    draft_ms = 1000 * verify_seconds(draft, n_max=1, recalibrate=args.recalibrate)[0]
    print(f"target forward ms by tokens: {', '.join(f'{n + 1}: {t:.1f}' for n, t in enumerate(curve))}; "
          f"draft one-token forward {draft_ms:.1f} ms")

    def cost(n):  # the target's forward over n tokens
        return curve[min(n, len(curve)) - 1]

    def replay(runs, k, ends, fork=False):
        """Replayed speed-up over plain decoding; `ends(probabilities so far, agreed so far)`
        says whether the chain ends after its last token."""
        tokens = seconds = 0.0
        for _, agree, sure, second in runs:
            pos = 0
            while pos < len(agree):
                n, unsure = 0, False  # drafted: up to k, or until the rule ends the chain
                while n < k and pos + n < len(agree):
                    n += 1
                    if ends(sure[pos : pos + n], agree[pos : pos + n]):
                        unsure = True
                        break
                kept = 0
                while kept < n and agree[pos + kept]:
                    kept += 1
                rows = n + 1 + (fork and unsure)  # the runner-up beside the unsure token
                if fork and unsure and kept == n - 1 and second[pos + kept]:
                    kept += 1
                tokens += kept + 1
                seconds += n * draft_ms + cost(rows)
                pos += kept + 1
        return curve[0] * tokens / seconds

    rules = [(f"token < {t:g}", lambda s, a, t=t: s[-1] < t, False) for t in thresholds]
    if args.fork:
        rules += [(f"token < {t:g} +fork", lambda s, a, t=t: s[-1] < t, True) for t in thresholds]
    rules += [(f"product < {t:g}", lambda s, a, t=t: math.prod(s) < t, False) for t in products]
    rules.append(("oracle", lambda s, a: not a[-1], False))
    pairs = [(c, a) for _, agree, sure, _ in texts for c, a in zip(sure, agree)]
    print("tokens the target kept, by the draft's probability: " + ", ".join(
        f"{b / 10:.1f}-{(b + 1) / 10:.1f} {sum(a for c, a in sel) / len(sel):.0%} of {len(sel)}"
        for b in range(10) if (sel := [(c, a) for c, a in pairs if min(int(c * 10), 9) == b])))
    print(f"{'chain ends':>20s} " + " ".join(f"{'k=' + str(k):>7s}" for k in lengths) + "  best k: per suite")
    for name, ends, fork in rules:
        rates = [replay(texts, k, ends, fork) for k in lengths]
        best = lengths[max(range(len(lengths)), key=rates.__getitem__)]
        per = {s: replay([t for t in texts if t[0] == s], best, ends, fork) for s in SUITES}
        print(f"{name:>20s} " + " ".join(f"{r:6.2f}x" for r in rates)
              + f"  k={best}: " + ", ".join(f"{s} {r:.2f}x" for s, r in per.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
