"""Running the comparison fairly: warm-up, methods interleaved prompt by prompt, repeats.

Every method is timed the same way, from outside, on the responses it streams:
decode speed counts the tokens after the first step over the time since that
step ended (mlx-lm's speculative loop emits its first block at once, ours
emits the prefill's token alone; both are then measured in steady state).
The order of methods rotates from prompt to prompt, so none always runs first
(cold caches) or last (a busy machine), and a speed-up is only ever a ratio of
two runs of the same prompt in the same round.
"""

from __future__ import annotations

import sys
import time
from typing import Callable

from .methods import Context, Variant
from .suites import Prompt, encode_chat

WARMUP_TEXT = "Say hello in one short sentence."


def steps_from_flags(flags: list[bool], k: int, max_tokens: int) -> list[tuple[int, int]]:
    """(drafted, accepted) per verify step, rebuilt from mlx-lm's `from_draft` flags.

    mlx-lm's speculative step emits its accepted drafts (True) then the
    target's own token (False), and drafts min(k, tokens left) each time.
    """
    steps, run, start = [], 0, 0
    for f in flags:
        if f:
            run += 1
            continue
        steps.append((min(k, max_tokens - start), run))
        start, run = start + run + 1, 0
    if run:  # the last block was cut by max_tokens or EOS
        steps.append((min(k, max_tokens - start), run))
    return steps


def acceptance(steps: list[tuple[int, int]]) -> dict:
    """Totals over verify steps: forwards, drafted, accepted and per-position counts."""
    pos_d: list[int] = []
    pos_a: list[int] = []
    for drafted, accepted in steps:
        pos_d += [0] * (drafted - len(pos_d))
        pos_a += [0] * (drafted - len(pos_a))
        for i in range(drafted):
            pos_d[i] += 1
            pos_a[i] += i < accepted
    return {
        "forwards": len(steps),
        "drafted": sum(d for d, _ in steps),
        "accepted": sum(a for _, a in steps),
        "pos_drafted": pos_d,
        "pos_accepted": pos_a,
    }


def run_once(variant: Variant, ctx: Context, ids: list[int], max_tokens: int,
             seed: int | None) -> dict:
    """Generate once and measure it; returns a JSON-ready record."""
    import mlx.core as mx

    mx.reset_peak_memory()
    tokens, flags, times, last = [], [], [], None
    tic, cpu = time.perf_counter(), time.process_time()
    for r in variant.method.stream(ctx, ids, variant.k, max_tokens, seed):
        times.append(time.perf_counter() - tic)
        tokens.append(int(r.token))
        flags.append(bool(r.from_draft))
        last = r
    peak = mx.get_peak_memory() / 1e9
    cpu = time.process_time() - cpu  # all threads; far below wall time x cores = a busy machine
    stats = getattr(last, "stats", None)
    if stats is not None and stats.trace is not None:  # mlx-spec: the loop's own record
        steps = [(len(s.proposed), s.accepted) for s in stats.trace]
        emitted = stats.step_tokens  # (a block cut at a drafted EOS: its kept drafts, no bonus)
    elif isinstance(variant.k, int):  # mlx-lm speculative
        steps = steps_from_flags(flags, variant.k, max_tokens)
        emitted = sum(a + 1 for _, a in steps) - (1 if flags and flags[-1] else 0)  # (a block cut short)
    else:  # plain decoding: one forward per token after the prefill
        steps = [(0, 0)] * max(len(tokens) - 1, 0)
        emitted = len(steps)
    # Decode speed is timed from the end of the first verify, which every speculative method
    # has: mlx-lm yields the prompt's own token with its first verified block, whose end is the
    # first token the target chose itself; mlx-spec yields it as soon as the prompt is read, so
    # its first verify ends at the second. Plain decoding's clock starts at the prompt's token.
    chosen = [i for i, drafted in enumerate(flags) if not drafted]
    skip = 1 if stats is not None and stats.trace is not None else 0
    b = chosen[min(skip, len(chosen) - 1)] if chosen else len(flags) - 1
    decode_time = times[-1] - times[b] if times else 0.0
    return {
        "method": variant.label,
        "prompt_tokens": len(ids),
        "generated": len(tokens),
        "ttft_s": times[0] if times else None,
        "total_s": times[-1] if times else None,
        "prompt_tps": len(ids) / times[0] if times and times[0] > 0 else None,
        "decode_tps": (len(tokens) - 1 - b) / decode_time if decode_time > 0 else None,
        "e2e_tps": len(tokens) / times[-1] if times and times[-1] > 0 else None,
        "peak_memory_gb": peak,
        "cpu_s": cpu,
        "from_draft": sum(flags),
        "tokens": tokens,
        "step_tokens": emitted,  # tokens the verify steps emitted: tau is this over the forwards
        **acceptance(steps),
    }


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def run_bench(
    ctx: Context,
    variants: list[Variant],
    prompts: list[Prompt],
    *,
    repeats: int = 1,
    max_tokens: int = 64,
    seed: int | None = 0,
    warmup: bool = True,
    progress: Callable[[str], None] = _stderr,
) -> list[dict]:
    """Run every variant on every prompt `repeats` times; returns one record per run.

    `seed` (+ the prompt's index) reaches the methods only when they sample: a seeded request
    gets a fresh `auto` policy that learns nothing between requests (so that it repeats), and a
    greedy run repeats without one, so greedy runs are unseeded, as most users' are, and what
    `auto` learns carries over from prompt to prompt."""
    encoded = [encode_chat(ctx.tokenizer, p.text) for p in prompts]
    if not ctx.temp:
        seed = None
    if warmup:
        # Untimed: first calls build kernels and grow the allocator's pools.
        warm_ids = encode_chat(ctx.tokenizer, WARMUP_TEXT)
        for v in variants:
            progress(f"warm-up {v.label}")
            run_once(v, ctx, warm_ids, min(8, max_tokens), seed)
    total = repeats * len(prompts) * len(variants)
    records: list[dict] = []
    tic = time.perf_counter()
    for rep in range(repeats):
        for i, (prompt, ids) in enumerate(zip(prompts, encoded)):
            shift = (i + rep) % len(variants)
            order = variants[shift:] + variants[:shift]
            p_seed = None if seed is None else seed + i
            for v in order:
                rec = run_once(v, ctx, ids, max_tokens, p_seed)
                rec.update(suite=prompt.suite, prompt=prompt.id, repeat=rep)
                records.append(rec)
                progress(_line(len(records), total, rec, time.perf_counter() - tic))
    return records


def _line(done: int, total: int, rec: dict, elapsed: float) -> str:
    eta = elapsed / done * (total - done)
    tps = rec["decode_tps"] or 0.0
    return (
        f"[{done}/{total}] {rec['suite']}/{rec['prompt']} r{rec['repeat']} {rec['method']}: "
        f"{rec['generated']} tok, {tps:.2f} tok/s decode, {rec['prompt_tps'] or 0:.1f} tok/s "
        f"prompt, {rec['from_draft']} from draft | eta {eta / 60:.1f} min"
    )
