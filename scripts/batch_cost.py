"""What a batched verify costs: one target forward over B rows x T tokens, against 1 x 1.

    python scripts/batch_cost.py [--model smollm2-135m-instruct] [--context 400]
        [--shapes 1x1,1x5,1x10,1x20,2x1,2x5,4x1,4x5,8x1,8x3] [--rounds 7]

Each shape is a forward of T new tokens in each of B rows over `--context` cached tokens
(mlx-lm's own caches: `KVCache` for one row, `BatchKVCache` for several), trimmed back
after each forward so every round sees the same context. The shapes run interleaved,
round after round (the machine is shared; ratios taken in one run mean more than times);
printed: median ms and the ratio to 1 x 1. When B x T costs what 1 x (B * T) does, a
batch's step is bound by its arithmetic, and verifying drafts in a large batch costs
nearly what they save.
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
    p.add_argument("--context", type=int, default=400)
    p.add_argument("--shapes", default="1x1,1x5,1x10,1x20,2x1,2x5,4x1,4x5,8x1,8x3")
    p.add_argument("--rounds", type=int, default=7)
    args = p.parse_args()

    import mlx.core as mx
    from mlx_lm.models.cache import BatchKVCache, make_prompt_cache

    import mlx_spec
    from mlx_spec.generate_cli import resolve_model

    model, _ = mlx_spec.load(resolve_model(args.model))
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
    if (1, 1) not in shapes:
        shapes.insert(0, (1, 1))
    context = mx.array([[10 + i % 1000 for i in range(args.context)]])

    def forward(rows: int, tokens: int):
        if rows == 1:
            cache = make_prompt_cache(model)
        else:
            cache = [BatchKVCache(left_padding=[0] * rows) for _ in model.layers]
        model(mx.broadcast_to(context, (rows, args.context)), cache=cache)
        mx.eval([c.state for c in cache])
        block = mx.full((rows, tokens), 5, mx.int32)

        def run() -> float:
            tic = time.perf_counter()
            mx.eval(model(block, cache=cache))
            seconds = time.perf_counter() - tic
            for c in cache:
                c.trim(tokens)
            return seconds

        return run

    runs = {s: forward(*s) for s in shapes}
    times = {s: [] for s in shapes}
    for _ in range(args.rounds + 1):  # the first round warms up
        for s, run in runs.items():
            times[s].append(run())
    base = statistics.median(times[(1, 1)][1:])
    print(f"{args.model}, {args.context} cached tokens, {args.rounds} rounds")
    for (rows, tokens), ts in times.items():
        ms = statistics.median(ts[1:])
        print(f"{rows} x {tokens:<3d} {1000 * ms:8.1f} ms {ms / base:6.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
