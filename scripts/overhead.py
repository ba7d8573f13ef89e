"""Host time per decode step: mlx-spec against mlx-lm's plain and speculative loops.

    python scripts/overhead.py [--model smollm2-135m-instruct] [--draft-model NAME] [--k 4]
    python scripts/overhead.py --gpu-like      # 30 layers of width 64, --model's tokenizer (49k)
    python scripts/overhead.py --policy        # the draft-length policy's own cost per step (one row, a batch)

Real model: per method, interleaved over rounds (medians printed), milliseconds per step,
of which host milliseconds (time during which MLX had none of the step's work queued:
mlx-spec's `stats.host_ms_per_step`), and tokens/s; each speculative method also runs
with its forwards built whole before evaluation ("no-overlap", `mlx_spec.overlap`), the
"before" of piecewise evaluation, and with its verify's layers building the "causal" mask
themselves ("causal-mask", `verify.ARRAY_MASKS = False`), the "before" of shared array masks. mlx-lm's loops give no such split; their ms per
token is printed.

GPU-like regime: a model whose arithmetic is negligible, so a step costs its fixed
per-step work, as on a fast GPU. Its output layer emits only tokens that decode to whole
text (`--byte-fragments`: any token, as a random model does; the streaming detokenizer
then re-decodes unfinished bytes after each, which real text rarely makes it do). Printed: ms per step of mlx-lm's plain loop
(`generate_step`, and `stream_generate`, which detokenizes and builds a response per
token as mlx-spec does), mlx-spec's
plain loop and an n-gram verify step (k drafted; also without piecewise evaluation, and
without shared array masks), and each one's ratio to mlx-lm's plain;
the same for CPU time per step (the process's, all threads), which other jobs on a shared
machine disturb much less than wall time (but which cannot show overlap).
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
    p.add_argument("--draft-model", default=None)
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=None, help="tokens a run (96; GPU-like: 200)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--gpu-like", action="store_true")
    p.add_argument("--policy", action="store_true")
    p.add_argument("--byte-fragments", action="store_true",
                   help="GPU-like: let the random model emit byte-fragment tokens too")
    p.add_argument("--pairs", type=int, default=0, metavar="N",
                   help="GPU-like: only N rounds of whole plain runs, mlx-spec vs mlx-lm's "
                        "generate_step and stream_generate, interleaved")
    args = p.parse_args()
    if args.pairs == 1 or args.pairs < 0:
        p.error("--pairs takes at least 2 rounds (its quartiles need two), or 0 for the other measurements")
    if args.policy or args.gpu_like:
        return policy(args) if args.policy else gpu_like(args)
    args.max_tokens = args.max_tokens or 96
    return real(args)


def _median(xs):
    return statistics.median(xs) if xs else float("nan")


def real(args) -> int:
    import mlx.core as mx
    from mlx_lm.generate import generate_step, speculative_generate_step

    import mlx_spec
    from mlx_spec import overlap, verify
    from mlx_spec.generate_cli import resolve_model

    model, tok = mlx_spec.load(resolve_model(args.model))
    text = "Rewrite this list with one item per line: apples, pears, plums, cherries, figs."
    ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
    methods = {"mlx-spec none": lambda: None, "mlx-spec ngram": mlx_spec.NGramDrafter}
    draft = None
    if args.draft_model:
        draft, draft_tok = mlx_spec.load(resolve_model(args.draft_model))
        methods["mlx-spec draft"] = lambda: mlx_spec.DraftModelDrafter(draft, draft_tok)

    def ours(make, every, masks=True):
        overlap.EVERY, verify.ARRAY_MASKS = every, masks
        out = list(mlx_spec.stream_generate(model, tok, ids, make(), max_tokens=args.max_tokens,
                                            num_draft_tokens=args.k))
        s = out[-1].stats
        return s.step_seconds / s.target_forwards * 1e3, s.host_ms_per_step, s.generation_tps

    def theirs(spec: bool):
        tic, n = time.perf_counter(), 0
        gen = (speculative_generate_step(mx.array(ids), model, draft, num_draft_tokens=args.k,
                                         max_tokens=args.max_tokens) if spec
               else generate_step(mx.array(ids), model, max_tokens=args.max_tokens))
        for _ in gen:
            n += 1
        return (time.perf_counter() - tic) / n * 1e3

    every = overlap.EVERY
    tags = (("", (every, True)), (" no-overlap", (0, True)), (" causal-mask", (every, False)))
    variants = {f"{name}{tag}": (make, p) for name, make in methods.items()
                for tag, p in tags if not tag or name != "mlx-spec none"}
    rows = {name: [] for name in variants}
    mlx_lm = {"mlx-lm plain": [], **({"mlx-lm draft": []} if draft is not None else {})}
    for r in range(args.rounds + 1):  # round 0 warms up
        for name, (make, p) in variants.items():
            got = ours(make, *p)
            if r:
                rows[name].append(got)
        for name in mlx_lm:
            got = theirs(name == "mlx-lm draft")
            if r:
                mlx_lm[name].append(got)
    print(f"{args.model}, {args.max_tokens} tokens, k {args.k}, {args.rounds} rounds (medians)")
    for name, runs in rows.items():
        step, host, tps = (_median([x[i] for x in runs]) for i in range(3))
        print(f"{name:27s} {step:7.1f} ms/step  host {host:5.2f} ms ({host / step:5.1%})  {tps:6.2f} tok/s")
    for name, runs in mlx_lm.items():
        ms = _median(runs)
        print(f"{name:27s} {ms:7.1f} ms/token                       {1e3 / ms:6.2f} tok/s")
    return 0


def gpu_like_model(name: str, byte_fragments: bool = False):
    """The GPU-like regime's target: 30 llama layers of width 64 with a real vocabulary (the
    tokenizer of the zoo model `name`), random weights; returns (model, tokenizer)."""
    import mlx.core as mx
    from mlx_lm.models import llama

    import mlx_spec
    from mlx_spec.generate_cli import resolve_model

    mx.random.seed(0)
    margs = llama.ModelArgs(model_type="llama", hidden_size=64, num_hidden_layers=30, intermediate_size=128,
                            num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5,
                            vocab_size=49152, tie_word_embeddings=False)
    model = llama.Model(margs)
    mx.eval(model.parameters())
    _, tok = mlx_spec.load(resolve_model(name))  # a real tokenizer (the zoo's SmolLM2: 49152 tokens)
    if not byte_fragments:
        # A random model picks byte-fragment tokens (pieces of multi-byte UTF-8 characters) as
        # often as any, and a streaming detokenizer re-decodes its unfinished bytes after each
        # one: 0.76 ms a token here, a cost real text rarely has. Its output layer is limited
        # to tokens that decode to whole text, as most of a real model's output does.
        fragments = [t for t in range(margs.vocab_size) if "\ufffd" in tok.decode([t])]
        w = model.lm_head.weight
        w[mx.array(fragments)] = 0  # their logits are 0; whole-text ones' maximum is far above
        model.lm_head.weight = w
        mx.eval(model.parameters())
    return model, tok


def gpu_like(args) -> int:
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    import mlx_spec
    from mlx_spec import overlap, verify

    model, tok = gpu_like_model(args.model, args.byte_fragments)
    prompt = [5, 6, 7, 8] * 8
    n = args.max_tokens or 200  # short runs, many rounds: interleaving beats a noisy machine

    ends: list[float] = []  # when each step of the last run ended (its last token arrived)

    def mlx_lm_plain():
        tic, cpu, count = time.perf_counter(), time.process_time(), 0
        ends.clear()
        for _ in generate_step(mx.array(prompt), model, max_tokens=n):
            count += 1
            ends.append(time.perf_counter())
        return (time.perf_counter() - tic) / count * 1e3, (time.process_time() - cpu) / count * 1e3

    def mlx_lm_stream():  # with detokenizing and a response per token, as ours does
        from mlx_lm.generate import stream_generate

        tic, cpu, count = time.perf_counter(), time.process_time(), 0
        ends.clear()
        for _ in stream_generate(model, tok, prompt, max_tokens=n):
            count += 1
            ends.append(time.perf_counter())
        return (time.perf_counter() - tic) / count * 1e3, (time.process_time() - cpu) / count * 1e3

    def ours(drafter, every=overlap.EVERY, masks=True):
        overlap.EVERY, verify.ARRAY_MASKS = every, masks
        cpu = time.process_time()
        ends.clear()
        out = []
        for r in mlx_spec.stream_generate(model, tok, prompt, drafter, max_tokens=n, num_draft_tokens=args.k):
            out.append(r)
            if not r.from_draft:  # a block's last token: the target's own
                ends.append(time.perf_counter())
        s = out[-1].stats
        cpu_ms = (time.process_time() - cpu) / s.target_forwards * 1e3
        return s.step_seconds / s.target_forwards * 1e3, cpu_ms, s.drafted / s.target_forwards

    if args.pairs:  # the plain loops alone, whole runs alternating (which goes first, too)
        def ours_whole():  # per token over the whole run, prefill included, as mlx_lm_plain's
            tic = time.perf_counter()
            count = sum(1 for _ in mlx_spec.stream_generate(model, tok, prompt, None, max_tokens=n))
            return (time.perf_counter() - tic) / count * 1e3, None

        # mlx-lm's generate_step yields token ids; its stream_generate also detokenizes and
        # builds a response per token, as mlx-spec's stream_generate does: both are compared.
        loops = {"generate_step": mlx_lm_plain, "stream_generate": mlx_lm_stream, "ours": ours_whole}
        ratios = {"generate_step": [], "stream_generate": []}
        names = list(loops)
        for i in range(args.pairs + 1):  # whole runs, the order rotating each round
            ms = {name: loops[name]()[0] for name in names[i % 3:] + names[: i % 3]}
            if i:  # the first round warms up
                for name in ratios:
                    ratios[name].append(ms["ours"] / ms[name])
        for name, rs in ratios.items():
            q = statistics.quantiles(rs, n=4)
            print(f"mlx-spec plain / mlx-lm {name}, {args.pairs} rounds of {n}-token runs: median "
                  f"{_median(rs):.3f}x (quartiles {q[0]:.3f}-{q[2]:.3f})")
        return 0

    class AlwaysK(mlx_spec.NGramDrafter):
        """Prompt lookup that always proposes k tokens (repeating y when the index has
        nothing), so every step verifies k + 1 tokens: the step cost being measured."""

        def propose(self, y, k, sampling):
            draft = super().propose(y, k, sampling)
            return draft if draft.size == k else mlx_spec.Draft(mx.full((k,), y, mx.uint32))

    res = {"mlx-lm plain": [], "mlx-lm stream": [], "mlx-spec plain": [], f"mlx-spec ngram k={args.k}": [],
           f"mlx-spec ngram k={args.k} no-overlap": [], f"mlx-spec ngram k={args.k} causal-mask": []}
    cpu = {name: [] for name in res}
    periods = {name: [] for name in res}  # step to step, steady state (after the first two)
    runs = {"mlx-lm plain": mlx_lm_plain, "mlx-lm stream": mlx_lm_stream,
            "mlx-spec plain": lambda: ours(None), f"mlx-spec ngram k={args.k}": lambda: ours(AlwaysK()),
            f"mlx-spec ngram k={args.k} no-overlap": lambda: ours(AlwaysK(), 0),
            f"mlx-spec ngram k={args.k} causal-mask": lambda: ours(AlwaysK(), masks=False)}
    for r in range(args.rounds + 1):
        for name, run in runs.items():
            wall, cpu_ms, *rest = run()
            if name == f"mlx-spec ngram k={args.k}":
                drafted = rest[0]
            if r:
                res[name].append(wall)
                cpu[name].append(cpu_ms)
                periods[name] += [b - a for a, b in zip(ends[2:], ends[3:])]
    base, cpu_base = _median(res["mlx-lm plain"]), _median(cpu["mlx-lm plain"])
    print(f"(the n-gram steps verified {drafted:.1f} drafted tokens on average)")
    ngram = res[f"mlx-spec ngram k={args.k}"]
    print("paired per round, n-gram step / mlx-lm plain step: "
          + ", ".join(f"{a / b:.2f}" for a, b in zip(ngram, res["mlx-lm plain"]))
          + f" (median {_median([a / b for a, b in zip(ngram, res['mlx-lm plain'])]):.3f}); mlx-spec plain / "
          f"mlx-lm plain median {_median([a / b for a, b in zip(res['mlx-spec plain'], res['mlx-lm plain'])]):.3f}")
    print(f"GPU-like regime (30 x 64 llama, 49152 vocabulary), {n} tokens, {args.rounds} rounds (medians);")
    print("wall: ms per step; cpu: CPU ms (all threads) per step, less sensitive to other jobs on the machine")
    for name, walls in res.items():
        ms, c = _median(walls), _median(cpu[name])
        print(f"{name:31s} wall {ms:6.2f} ms {ms / base:5.2f}x   cpu {c:6.2f} ms {c / cpu_base:5.2f}x   "
              f"(wall runs: {', '.join(f'{x:.1f}' for x in walls)})")
    # One step's period (end of a step's block to the end of the next, detokenizing and the
    # caller included), median over every steady-state step of every round: a slow spell of
    # the machine moves a few steps, not the median.
    print("median step period over all rounds (the robust measure on a shared machine):")
    p_base = _median(periods["mlx-lm plain"])
    for name, ps in periods.items():
        print(f"{name:31s} {_median(ps) * 1e3:6.2f} ms {_median(ps) / p_base:5.2f}x   ({len(ps)} steps)")
    return 0


def policy(args) -> int:
    """Microseconds per step of the draft-length policy (`choose` then `observe`), for
    growing k_max, with the replay term of recurrent targets; plus what a tree step adds
    (`tree_shape.ShapeChoice`: how much of the tree to verify)."""
    import random

    from mlx_spec.adaptive import AdaptiveK, CostModel

    costs = CostModel([0.01 * (1 + 0.05 * n) for n in range(17)], 0.0005)
    print("draft-length policy, one step = choose() + observe(), median of 2000 steps "
          "(acceptance 0.7 per position)")
    for k_max in (4, 8, 16):
        for replays in (False, True):
            policy, rnd, times = AdaptiveK(costs, k_max, replays=replays), random.Random(0), []
            for _ in range(2000):
                tic = time.perf_counter()
                k, _ = policy.choose()
                n = 0
                while n < k and rnd.random() < 0.7:
                    n += 1
                policy.observe(k, n, 0.01 * (1 + 0.05 * k))
                times.append(time.perf_counter() - tic)
            kind = "recurrent target (replays)" if replays else "KV target"
            print(f"k_max {k_max:2d}, {kind:27s} {_median(times) * 1e6:6.1f} us")
    from mlx_spec.tree_shape import ShapeChoice

    shapes, times = ShapeChoice(), []
    for i in range(2000):
        tic = time.perf_counter()
        shapes.observe(shapes.pick(), 1 + i % 4, 0.01)
        times.append(time.perf_counter() - tic)
    print(f"tree shape choice (pick + observe)          {_median(times) * 1e6:6.1f} us")
    batch_policy(costs)
    return 0


def batch_policy(costs) -> None:
    """Microseconds per step of a batch's draft-length choice for B rows on `auto` (k_max 16):
    `choose_for_batch`, then `plain_next` (what a parked batch asks before queueing a step)."""
    import random

    import mlx.core as mx
    from mlx_lm.models import llama

    from mlx_spec import batch_policy, calibration
    from mlx_spec.adaptive import AdaptiveK

    margs = llama.ModelArgs(model_type="llama", hidden_size=16, num_hidden_layers=1, intermediate_size=32,
                            num_attention_heads=2, num_key_value_heads=1, rms_norm_eps=1e-5, vocab_size=64)
    model = llama.Model(margs)
    mx.eval(model.parameters())
    calibration._CURVES[calibration.model_key(model) + ":wide"] = [0.01 * w / 17 for w in batch_policy.WIDE]
    print("batch draft-length choice, one step = choose_for_batch() + plain_next(), k_max 16, median of 500 steps")
    for rows in (2, 4, 8):
        policies, rnd, times = [AdaptiveK(costs, 16, timed=False) for _ in range(rows)], random.Random(0), []
        for _ in range(500):
            tic = time.perf_counter()
            ks = batch_policy.choose_for_batch(model, policies)
            batch_policy.plain_next(model, policies)
            times.append(time.perf_counter() - tic)
            for p, (k, _) in zip(policies, ks):
                n = 0
                while n < k and rnd.random() < 0.3:
                    n += 1
                p.offered(k, k)
                p.observe(k, n)
        print(f"{rows} rows                                     {_median(times) * 1e6:6.1f} us")


if __name__ == "__main__":
    sys.exit(main())
