"""Concurrent streams: mlx-lm's batching, mlx-spec one request at a time, mlx-spec batched.

    python scripts/batch_bench.py [--model smollm2-135m-instruct] [--draft-model NAME]
        [--suites code-edit,chat] [--streams 1,2,4,8] [--max-tokens 64] [--rounds 2] [--plain]
        [--branches N]

For each suite and number of concurrent streams c, the same c prompts (greedy) go through
  * mlx-lm    mlx_lm.generate.batch_generate: continuous batching, no speculation;
  * spec-1    mlx-spec one request after the other, with speculation (what a server that
              cannot batch speculation does);
  * spec-B    mlx-spec's BatchDecoder: all c rows verified together, each with its own draft.
With `--plain` mlx-spec runs without a drafter: its batching alone against mlx-lm's.
With `--branches N` (N >= 2) a fourth method, spec-T, is spec-B with draft trees (the
drafter's N-branch trees, `auto` choosing each step how much of each tree to verify).
The three run interleaved in every round (the machine is shared and noisy; ratios taken in
one run mean more than absolute times). Printed per cell: total tokens/s summed over streams
(median over rounds), mean per-stream latency (seconds until a stream's last token), and
whether all three gave the same tokens.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time


def main() -> int:
    from mlx_spec.fastblas import restart_with_fast_blas

    restart_with_fast_blas()
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--draft-model", default=None, help="draft with this model (default: n-gram)")
    p.add_argument("--plain", action="store_true",
                   help="mlx-spec without a drafter: its batching against mlx-lm's, nothing else")
    p.add_argument("--suites", default="code-edit,chat")
    p.add_argument("--streams", default="1,2,4,8")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--num-draft-tokens", default="auto")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--branches", type=int, default=1, help="also spec-T: spec-B with N-branch draft trees")
    args = p.parse_args()

    import mlx_spec
    from mlx_spec.bench.suites import encode_chat, load_suite
    from mlx_spec.generate_cli import resolve_model

    model, tok = mlx_spec.load(resolve_model(args.model))
    if args.draft_model:
        draft, draft_tok = mlx_spec.load(resolve_model(args.draft_model))

    def drafter(branches: int):
        if args.plain:
            return None
        if args.draft_model:
            return mlx_spec.DraftModelDrafter(draft, draft_tok, branches=branches)
        return mlx_spec.NGramDrafter(branches=branches)

    template = drafter(1)
    k = args.num_draft_tokens if args.num_draft_tokens == "auto" else int(args.num_draft_tokens)
    methods = {"mlx-lm": (run_mlx_lm, template), "spec-1": (run_one_by_one, template),
               "spec-B": (run_batched, template)}
    if args.branches > 1 and not args.plain:
        methods["spec-T"] = (run_batched, drafter(args.branches))
    print(f"model {args.model}, drafter {type(template).__name__ if template else None}, {args.max_tokens} tokens a stream, "
          f"k {k}, {args.rounds} rounds")
    print(f"{'suite':10s} {'streams':>7s} " + " ".join(f"{m + ' tok/s':>13s} {'lat s':>6s}" for m in methods)
          + "  same  spec-B/best")
    for suite in args.suites.split(","):
        texts = [pr.text for pr in load_suite(suite)]
        for c in [int(s) for s in args.streams.split(",")]:
            prompts = [encode_chat(tok, texts[i % len(texts)]) for i in range(c)]
            rates = {m: [] for m in methods}
            lats = {m: [] for m in methods}
            outs = {}
            for _ in range(args.rounds + 1):  # round 0 warms up (calibration, caches)
                for name, (fn, made) in methods.items():
                    tic = time.perf_counter()
                    tokens, done = fn(model, tok, prompts, made, args.max_tokens, k)
                    wall = time.perf_counter() - tic
                    rates[name].append(sum(len(t) for t in tokens) / wall)
                    if name == "spec-T":
                        tree_steps = sum(TREE_STEPS)
                    TREE_STEPS.clear()
                    lats[name].append(statistics.mean(d - tic for d in done))
                    outs[name] = tokens
            row = " ".join(f"{statistics.median(rates[m][1:]):13.2f} {statistics.median(lats[m][1:]):6.2f}"
                           for m in methods)
            same = all(out == outs["mlx-lm"] for out in outs.values())
            best = max(statistics.median(rates[m][1:]) for m in ("mlx-lm", "spec-1"))
            trees = (f"  spec-T/spec-B {statistics.median(rates['spec-T'][1:]) / statistics.median(rates['spec-B'][1:]):5.2f}x"
                     f" ({tree_steps} tree steps in spec-T's last round)" if "spec-T" in rates else "")
            print(f"{suite:10s} {c:7d} {row}  {'yes' if same else 'NO':4s}  "
                  f"{statistics.median(rates['spec-B'][1:]) / best:5.2f}x{trees}", flush=True)
    return 0


def run_mlx_lm(model, tok, prompts, template, max_tokens, k):
    from mlx_lm.generate import batch_generate

    res = batch_generate(model, tok, prompts, max_tokens=max_tokens, return_token_ids=True)
    done = time.perf_counter()
    return [_until_eos(t, tok) for t in res.token_ids], [done] * len(prompts)


def _until_eos(tokens, tok):
    """The tokens before the first EOS: mlx-lm's batch_generate leaves the EOS out of its
    token_ids and mlx-spec yields it, so all three are counted and compared without it."""
    tokens = list(tokens)
    for i, t in enumerate(tokens):
        if t in tok.eos_token_ids:
            return tokens[:i]
    return tokens


def run_one_by_one(model, tok, prompts, template, max_tokens, k):
    import mlx_spec

    tokens, done = [], []
    for p in prompts:
        tokens.append(_until_eos([r.token for r in mlx_spec.stream_generate(
            model, tok, p, template, max_tokens=max_tokens, num_draft_tokens=k)], tok))
        done.append(time.perf_counter())
    return tokens, done


TREE_STEPS: list[int] = []  # per finished batched row: its steps that verified a whole tree


def run_batched(model, tok, prompts, template, max_tokens, k):
    import mlx_spec

    decoder = mlx_spec.BatchDecoder(model, tok, max_batch=len(prompts))
    uids = [decoder.add(p, template and template.fork(), max_tokens=max_tokens, num_draft_tokens=k) for p in prompts]
    tokens, done = {u: [] for u in uids}, {}
    while decoder.busy:
        for uid, block in decoder.step():
            tokens[uid] += [r.token for r in block]
            if block and block[-1].finish_reason is not None:
                done[uid] = time.perf_counter()
                TREE_STEPS.append(block[-1].stats.tree_steps)
                decoder.release(uid)
    return [_until_eos(tokens[u], tok) for u in uids], [done[u] for u in uids]


if __name__ == "__main__":
    sys.exit(main())
