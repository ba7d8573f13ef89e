"""Chains vs trees vs mixed drafters, on the same prompts, interleaved.

    python scripts/tree_bench.py [--model smollm2-135m-instruct] [--draft-model NAME]
        [--suites code-edit,chat,code-gen] [--prompts 4] [--max-tokens 96] [--k auto|K]
        [--tree-budget N] [--tree-width W] [--methods plain,model,...] [--temp T --seed S]

Methods (greedy unless --temp; each prompt runs every method back to back, so ratios are
taken under the same machine load):
  * plain        no drafter;
  * ngram        n-gram chain;
  * ngram-tree   n-gram with branches=4 (several earlier matches as a trie);
  * model        draft-model chain, ended after a token drafted with p < 0.5 (with --draft-model);
  * model-full   draft-model chain of k tokens, never ended early (with --draft-model);
  * model-tree   draft model, branches=2            (with --draft-model);
  * model-dyn    draft model, EAGLE-2 dynamic tree of --tree-budget nodes (default: k, or 8
                 with auto), width --tree-width    (with --draft-model);
  * mixed        n-gram + draft model, one tree     (with --draft-model).
Printed per suite and method: decode tokens/s (total tokens over total decode time),
speed-up over plain, tau (tokens per target forward), rows (drafted rows verified per target
forward) and whether every output equals plain decoding token for token. With --temp > 0
every method samples (prompt i with seed S + i), so outputs differ from plain decoding's and
"same" reads "-": tau is then a random quantity, and more prompts and tokens narrow it.
"""

from __future__ import annotations

import argparse
import sys


def main() -> int:
    from mlx_spec.fastblas import restart_with_fast_blas

    restart_with_fast_blas()
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--draft-model", default=None)
    p.add_argument("--suites", default="code-edit,chat,code-gen")
    p.add_argument("--prompts", type=int, default=4, help="prompts per suite")
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--k", default="auto", help="draft length (node budget for trees): auto or 1..16")
    p.add_argument("--tree-budget", type=int, default=None, help="model-dyn's nodes (default: k, or 8)")
    p.add_argument("--tree-width", type=int, default=4, help="model-dyn's expansion width (default: 4)")
    p.add_argument("--methods", default=None, help="only these methods, comma-separated (plain always runs)")
    p.add_argument("--temp", type=float, default=0.0, help="sampling temperature (default: 0, greedy)")
    p.add_argument("--seed", type=int, default=0, help="prompt i samples with seed + i (with --temp)")
    args = p.parse_args()

    import mlx_spec
    from mlx_spec.bench.suites import encode_chat, load_suite
    from mlx_spec.generate_cli import resolve_model

    model, tok = mlx_spec.load(resolve_model(args.model))
    methods = {"plain": lambda: None, "ngram": mlx_spec.NGramDrafter,
               "ngram-tree": lambda: mlx_spec.NGramDrafter(branches=4)}
    if args.draft_model:
        draft, draft_tok = mlx_spec.load(resolve_model(args.draft_model))
        methods["model"] = lambda: mlx_spec.DraftModelDrafter(draft, draft_tok)
        methods["model-full"] = lambda: mlx_spec.DraftModelDrafter(draft, draft_tok, min_confidence=None)
        methods["model-tree"] = lambda: mlx_spec.DraftModelDrafter(draft, draft_tok, branches=2)
        budget = args.tree_budget or (8 if args.k == "auto" else int(args.k))
        methods["model-dyn"] = lambda: mlx_spec.DraftModelDrafter(draft, draft_tok, tree_budget=budget,
                                                                  tree_width=args.tree_width)
        methods["mixed"] = lambda: mlx_spec.MixedDrafter(mlx_spec.NGramDrafter(),
                                                         mlx_spec.DraftModelDrafter(draft, draft_tok))
    if args.methods:
        wanted = {"plain", *args.methods.split(",")}
        methods = {m: make for m, make in methods.items() if m in wanted}
    k = args.k if args.k == "auto" else int(args.k)
    print(f"model {args.model}, draft model {args.draft_model}, k {k}, {args.max_tokens} tokens, "
          f"{args.prompts} prompts a suite, temp {args.temp}")
    print(f"{'suite':10s} {'method':11s} {'tok/s':>7s} {'vs plain':>8s} {'tau':>5s} {'rows':>5s}  same")
    for suite in args.suites.split(","):
        prompts = [encode_chat(tok, pr.text) for pr in load_suite(suite)[: args.prompts]]
        tokens = {m: 0 for m in methods}
        seconds = {m: 0.0 for m in methods}
        forwards = {m: 0 for m in methods}
        verified = {m: 0 for m in methods}  # tokens the verify forwards emitted
        drafted = {m: 0 for m in methods}  # draft rows the verify forwards fed
        same = {m: True for m in methods}
        for i, prompt in enumerate([prompts[0]] + prompts):  # the first run warms up
            outs = {}
            for name, make in methods.items():
                drafter = make()
                out, stats = [], None
                extra = {"num_draft_tokens": k} if drafter else {}
                if args.temp > 0:
                    extra.update(temp=args.temp, seed=args.seed + i)
                for r in mlx_spec.stream_generate(model, tok, prompt, drafter, max_tokens=args.max_tokens, **extra):
                    out.append(r.token)
                    stats = r.stats
                outs[name] = out
                if i:
                    tokens[name] += len(out)
                    seconds[name] += len(out) / stats.generation_tps if stats.generation_tps else 0.0
                    forwards[name] += stats.target_forwards
                    verified[name] += stats.step_tokens  # (not the prompt pass's token)
                    drafted[name] += stats.drafted
            for name in methods:
                same[name] &= outs[name] == outs["plain"]
        base = tokens["plain"] / seconds["plain"]
        for name in methods:
            rate = tokens[name] / seconds[name]
            print(f"{suite:10s} {name:11s} {rate:7.2f} {rate / base:7.2f}x {verified[name] / forwards[name]:5.2f} "
                  f"{drafted[name] / forwards[name]:5.2f}  "
                  f"{'-' if args.temp > 0 else 'yes' if same[name] else 'NO'}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
