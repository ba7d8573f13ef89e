"""Per-step host overhead: the share of each decode step spent outside MLX evaluation.

    python scripts/overhead.py [--model smollm2-135m-instruct] [--draft-model NAME] [--k 4]

Prints, per drafter, tokens/s, tau and the host overhead (Python graph building and
bookkeeping between the step's one evaluation). Target: under 5% of step time.
"""

from __future__ import annotations

import argparse
import sys


def main() -> int:
    from mlx_spec.fastblas import restart_with_fast_blas

    restart_with_fast_blas([__file__, *sys.argv[1:]])
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--draft-model", default=None)
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=96)
    args = p.parse_args()

    import mlx_spec
    from mlx_spec.generate_cli import resolve_model

    model, tok = mlx_spec.load(resolve_model(args.model))
    drafters = {"none": None, "ngram": mlx_spec.NGramDrafter()}
    if args.draft_model:
        draft, draft_tok = mlx_spec.load(resolve_model(args.draft_model))
        drafters["draft-model"] = mlx_spec.DraftModelDrafter(draft, draft_tok)
    text = "Rewrite this list with one item per line: apples, pears, plums, cherries, figs."
    ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
    for name, drafter in drafters.items():
        for _ in range(2):  # the first run warms up
            *_, last = mlx_spec.stream_generate(model, tok, ids, drafter, max_tokens=args.max_tokens,
                                                num_draft_tokens=args.k)
        s = last.stats
        print(f"{name:12s} {s.generation_tps:6.2f} tok/s  tau {s.tau:4.2f}  "
              f"host overhead {s.host_overhead:5.1%} of {s.step_seconds / s.target_forwards * 1e3:.1f} ms/step")
    return 0


if __name__ == "__main__":
    sys.exit(main())
