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
"""

from __future__ import annotations

import argparse
import sys


def main() -> int:
    from mlx_spec.fastblas import restart_with_fast_blas

    restart_with_fast_blas([__file__, *sys.argv[1:]])
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    p.add_argument("--draft-model", default="qwen2.5-coder-0.5b-instruct")
    p.add_argument("--prompts-per-suite", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=40)
    p.add_argument("--thresholds", default="0,0.3,0.4,0.5,0.6")
    p.add_argument("--lengths", default="4,6,8,12,16")
    p.add_argument("--recalibrate", action="store_true", help="measure both models' forward costs again")
    args = p.parse_args()

    import mlx.core as mx
    from mlx_lm.generate import generate_step

    import mlx_spec
    from mlx_spec.bench.suites import SUITE_ORDER as SUITES, encode_chat, load_suite
    from mlx_spec.calibration import verify_seconds
    from mlx_spec.generate_cli import resolve_model

    target, tok = mlx_spec.load(resolve_model(args.model))
    draft, _ = mlx_spec.load(resolve_model(args.draft_model))
    lengths = [int(k) for k in args.lengths.split(",")]
    texts = []  # (suite, draft argmax == target token, draft's probability of its argmax)
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
            agree = [a == t for a, t in zip(mx.argmax(logits, axis=-1).tolist(), out)]
            texts.append((suite, agree, sure))
    curve = [1000 * t for t in verify_seconds(target, recalibrate=args.recalibrate)]  # ms, n = 1..17
    draft_ms = 1000 * verify_seconds(draft, n_max=1, recalibrate=args.recalibrate)[0]
    print(f"target forward ms by tokens: {', '.join(f'{n + 1}: {t:.1f}' for n, t in enumerate(curve))}; "
          f"draft one-token forward {draft_ms:.1f} ms")

    def cost(n):  # the target's forward over n tokens
        return curve[min(n, len(curve)) - 1]

    def replay(runs, k, stop):
        tokens = seconds = 0.0
        for _, agree, sure in runs:
            pos = 0
            while pos < len(agree):
                n = 0  # drafted: up to k, ending after the first unsure token
                while n < k and pos + n < len(agree):
                    n += 1
                    if sure[pos + n - 1] < stop:
                        break
                kept = 0
                while kept < n and agree[pos + kept]:
                    kept += 1
                tokens += kept + 1
                seconds += n * draft_ms + cost(n + 1)
                pos += kept + 1
        return curve[0] * tokens / seconds

    print(f"{'min_confidence':>14s} " + " ".join(f"{'k=' + str(k):>7s}" for k in lengths) + "  best k: per suite")
    for stop in (float(t) for t in args.thresholds.split(",")):
        rates = [replay(texts, k, stop) for k in lengths]
        best = lengths[max(range(len(lengths)), key=rates.__getitem__)]
        per = {s: replay([t for t in texts if t[0] == s], best, stop) for s in SUITES}
        print(f"{stop:14g} " + " ".join(f"{r:6.2f}x" for r in rates)
              + f"  k={best}: " + ", ".join(f"{s} {r:.2f}x" for s, r in per.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
