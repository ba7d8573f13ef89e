"""Adaptive draft length against a fixed one, with one drafter kept across prompts.

    python scripts/auto_vs_fixed.py [--model qwen2.5-coder-1.5b-instruct]
        [--draft-model qwen2.5-coder-0.5b-instruct | --ngram] [--k 4] [--max-tokens 40]

Runs the first prompt of each bench suite with `num_draft_tokens=K` and with "auto",
interleaved, each mode keeping its own drafter for the whole run (as an application
would, so what auto learns carries over), and prints tokens/s, tau and the chosen k.
"""

from __future__ import annotations

import argparse
import sys


def main() -> int:
    from mlx_spec.fastblas import restart_with_fast_blas

    restart_with_fast_blas()
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    p.add_argument("--draft-model", default="qwen2.5-coder-0.5b-instruct")
    p.add_argument("--ngram", action="store_true", help="draft with prompt lookup instead")
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=40)
    args = p.parse_args()

    import mlx_spec
    from mlx_spec.bench import suites
    from mlx_spec.generate_cli import resolve_model

    model, tok = mlx_spec.load(resolve_model(args.model))
    if args.ngram:
        make = mlx_spec.NGramDrafter
    else:
        draft, draft_tok = mlx_spec.load(resolve_model(args.draft_model))
        make = lambda: mlx_spec.DraftModelDrafter(draft, draft_tok)  # noqa: E731
    modes = {str(args.k): (make(), args.k), "auto": (make(), "auto")}
    for drafter, k in modes.values():  # warm up (and calibrate once)
        list(mlx_spec.stream_generate(model, tok, "hi", drafter, max_tokens=8, num_draft_tokens=k))
    totals = {label: [0, 0.0] for label in modes}
    for name in suites.suite_names():
        ids = suites.encode_chat(tok, suites.load_suite(name)[0].text)
        for label, (drafter, k) in modes.items():
            *_, last = mlx_spec.stream_generate(model, tok, ids, drafter,
                                                max_tokens=args.max_tokens, num_draft_tokens=k)
            s = last.stats
            totals[label][0] += s.generation_tokens
            totals[label][1] += s.generation_tokens / s.generation_tps
            print(f"{name:10s} k={label:5s} {s.generation_tps:6.2f} tok/s  tau {s.tau:4.2f}  "
                  f"chosen k {s.chosen_k}", flush=True)
    rates = {label: n / t for label, (n, t) in totals.items()}
    print("all suites: " + ", ".join(f"k={label} {r:.2f} tok/s" for label, r in rates.items())
          + f"; auto / k={args.k}: {rates['auto'] / rates[str(args.k)]:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
