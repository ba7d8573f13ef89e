"""What a draft model's LM head costs, and what a subset of it misses.

    python scripts/draft_head_cost.py [--draft-model qwen2.5-coder-0.5b-instruct]
        [--head-vocab 49152] [--context 300] [--rounds 8] [--coverage 3]

Timing: one-token and five-token draft forwards over `--context` cached tokens, the
model's own head (every row's logits) and the subset head (`DraftModelDrafter(head_vocab=N)`,
the last row's), interleaved over rounds; medians in ms.

`--coverage P`: the draft model's own greedy text (40 tokens) for the first P prompts of
each bench suite, and how many of its tokens lie outside ids < N for several N, and
outside them and the prompt's tokens too (what the subset head could not have proposed at
its first occurrence).
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
    p.add_argument("--draft-model", default="qwen2.5-coder-0.5b-instruct")
    p.add_argument("--head-vocab", type=int, default=None, help="default: DraftModelDrafter's")
    p.add_argument("--context", type=int, default=300)
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--coverage", type=int, default=0, metavar="P", help="prompts a suite (0: no coverage count)")
    args = p.parse_args()

    import mlx.core as mx
    from mlx_lm.generate import generate_step

    import mlx_spec
    from mlx_spec.bench import suites
    from mlx_spec.cache import make_cache
    from mlx_spec.drafters.base import vocab_size
    from mlx_spec.drafters.short_head import HEAD_VOCAB, short_head
    from mlx_spec.generate_cli import resolve_model

    n = args.head_vocab or HEAD_VOCAB
    model, tok = mlx_spec.load(resolve_model(args.draft_model))
    v = vocab_size(model)
    head = short_head(model, n, v)
    if head is None:
        print(f"no subset head for this model at {n} ids (vocabulary {v}, or its forward is not stack then head)")
        return 1
    cache = make_cache(model)
    model(mx.array([[100 + i % 5000 for i in range(args.context)]]), cache=cache)
    mx.eval([c.state for c in cache])
    runs = {
        "1 token, whole head": lambda x: model(x, cache=cache)[0, -1],
        "1 token, subset head": lambda x: head(x, cache, (), last=1)[0, -1],
        "5 tokens, whole head": lambda x: model(x, cache=cache)[0, -1],
        "5 tokens, subset head": lambda x: head(x, cache, (), last=1)[0, -1],
    }
    times: dict[str, list[float]] = {k: [] for k in runs}
    for _ in range(args.rounds):
        for label, f in runs.items():
            x = mx.array([[7] * int(label[0])])
            start = time.perf_counter()
            mx.eval(f(x))
            times[label].append(time.perf_counter() - start)
            for c in cache:
                c.trim(x.shape[1])
    print(f"{args.draft_model}: vocabulary {v}, subset {n} ids, context {args.context}, {args.rounds} rounds")
    for label, ts in times.items():
        print(f"  {label:22s} {1000 * statistics.median(ts):7.1f} ms")
    if args.coverage:
        cuts = sorted({32768, 49152, 65536, n})
        outside, unseen, total = dict.fromkeys(cuts, 0), dict.fromkeys(cuts, 0), 0
        for name in suites.suite_names():
            for prompt in suites.load_suite(name)[: args.coverage]:
                ids = suites.encode_chat(tok, prompt.text)
                out = [int(t) for t, _ in generate_step(mx.array(ids), model, max_tokens=40)]
                total += len(out)
                for c in cuts:
                    outside[c] += sum(t >= c for t in out)
                    unseen[c] += sum(t >= c and t not in ids for t in out)
        print(f"coverage over {total} tokens the draft wrote:")
        for c in cuts:
            print(f"  ids >= {c}: {outside[c]} (not in the prompt either: {unseen[c]})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
