"""One rank of a sharded-target test, started by `mlx.launch` (tests/test_distributed.py).

    python tests/dist_worker.py OUT_DIR MODE:TARGET:DRAFT[:quick][:noauto][:head][:v4][:mtp] [...] [desync]
    python tests/dist_worker.py OUT_DIR lossless RUNS
    python tests/dist_worker.py OUT_DIR real TARGET WINDOW TOKENS PROMPT [...]

For each setup (a target folder sharded by MODE, a draft model folder) it writes
OUT_DIR/rank{r}.json with the tokens of every run, so the test compares ranks
with each other and with the unsharded target; one launch checks several setups
(starting ranks costs seconds). `desync`: rank 1's drafter proposes other tokens
from its third proposal on (the sync check must fire). `head`: DRAFT is a converted
EAGLE-3 head folder (it reads decoder-layer taps), run greedy and sampled, traced.
`v4`: TARGET is a DeepSeek-V4 checkpoint with DSpark stages (DRAFT is not read).
`mtp`: TARGET is a checkpoint with an MTP module, drafting for it (DRAFT is not read).
"""

import json
import sys
from pathlib import Path

import mlx.core as mx

import mlx_spec
from mlx_spec import distributed

PROMPTS = ([5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [11, 3, 40, 41, 42, 11, 3, 40])
N = 24


class Desynced(mlx_spec.NGramDrafter):
    """An n-gram drafter that, on rank 1, drafts other tokens from its third proposal on."""

    calls = 0

    def propose(self, y, k, sampling):
        Desynced.calls += 1
        draft = super().propose(y, k, sampling)
        if Desynced.calls >= 3 and mx.distributed.init().rank() == 1 and k > 0:
            from mlx_spec.drafters.base import Draft

            tokens = (mx.arange(k) + 1).astype(mx.uint32)
            return Draft(tokens)
        return draft


def tokens(model, tok, prompt, drafter, **kw):
    return [r.token for r in mlx_spec.stream_generate(model, tok, prompt, drafter, max_tokens=N, **kw)]


def lossless(out: str, runs: int) -> None:
    """Seeded sampled runs of the chi-square harness's draft-model case on a tensor split."""
    from lossless import sampled_runs, v8_llama

    group = distributed.init()
    model, draft = v8_llama(), v8_llama(4.0)  # the same random weights on every rank
    distributed.shard_model(model, "tensor", group)
    got = sampled_runs(model, [1, 2, 3, 1, 2], lambda: mlx_spec.DraftModelDrafter(draft, min_confidence=None), runs,
                       max_tokens=5, k=3, vocab=8, temp=1.0)
    deep = sum(len(t[0].proposed) == 3 for t in got.traces if t)  # first steps with 3 drafts
    Path(out, f"rank{group.rank()}.json").write_text(json.dumps(
        {"tokens": got.tokens.tolist(), "deep_first_steps": deep}))


def real(out: str, target: str, window: int, n: int, prompts: list[str]) -> None:
    """Real weights on a pipeline split, the sliding window cut to `window` (gemma3):
    greedy tokens, plain and n-gram (k = 3), for each prompt."""
    group = distributed.init()
    model, tok = distributed.load(target, "pipeline", group)
    model.args.sliding_window = model.model.window_size = window
    result = {"layout": distributed.describe(model)}
    for i, text in enumerate(prompts):
        ids = tok.encode(text)
        run = lambda d, **kw: [r.token for r in mlx_spec.stream_generate(model, tok, ids, d, max_tokens=n, **kw)]
        result[f"plain{i}"], result[f"ngram{i}"] = run(None), run(mlx_spec.NGramDrafter(), num_draft_tokens=3)
    Path(out, f"rank{group.rank()}.json").write_text(json.dumps(result))


def main() -> None:
    if sys.argv[2] == "lossless":
        return lossless(sys.argv[1], int(sys.argv[3]))
    if sys.argv[2] == "real":
        return real(sys.argv[1], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), sys.argv[6:])
    out, setups = sys.argv[1], [a for a in sys.argv[2:] if a != "desync"]
    group = distributed.init()
    results = {}
    for setup in setups:
        mode, target, draft, *flags = setup.split(":")
        model, tok = distributed.load(target, mode, group)
        if "desync" in sys.argv:
            tokens(model, tok, PROMPTS[0], Desynced(), num_draft_tokens=3)
            return
        if "head" in flags:
            results[setup] = run_head(model, tok, target, draft, "quick" in flags)
        elif "v4" in flags:
            results[setup] = run_v4(model, tok, target, mode)
        elif "mtp" in flags:
            results[setup] = run_mtp(model, tok, target)
        else:
            results[setup] = run_all(model, tok, target, draft, mode, "quick" in flags, "noauto" in flags)
        results[setup]["layout"] = distributed.describe(model)
    Path(out, f"rank{group.rank()}.json").write_text(json.dumps(results))


def run_all(model, tok, target: str, draft: str, mode: str, quick: bool, noauto: bool) -> dict:
    """Every drafter kind, greedy, and seeded sampled on a pipeline split (a tensor split
    sums partial products in another order, so its sampled tokens may differ from the
    unsharded target's); `quick`: the first prompt, n-gram only; `noauto`: no adaptive draft
    length (its calibration costs ~70 forwards)."""
    result = {}
    reference, _ = mlx_spec.load(target)
    draft_model, draft_tok = mlx_spec.load(draft)
    for i, prompt in enumerate(PROMPTS[:1] if quick else PROMPTS):
        result[f"unsharded{i}"] = tokens(reference, tok, prompt, None)
        result[f"plain{i}"] = tokens(model, tok, prompt, None)
        result[f"ngram{i}"] = tokens(model, tok, prompt, mlx_spec.NGramDrafter(), num_draft_tokens=3)
        if not (quick or noauto):
            result[f"ngram_auto{i}"] = tokens(model, tok, prompt, mlx_spec.NGramDrafter())
            result[f"tree_auto{i}"] = tree_auto(model, tok, prompt)
            result[f"ahead_auto{i}"] = ahead_auto(model, tok, prompt)
        if not quick:
            result[f"draft_model{i}"] = tokens(model, tok, prompt,
                                               mlx_spec.DraftModelDrafter(draft_model, draft_tok),
                                               num_draft_tokens=4)
        for seed in () if mode != "pipeline" else (1,) if quick else (1, 2):
            opts = dict(temp=1.0, seed=seed, num_draft_tokens=3)
            result[f"sampled{i}_{seed}"] = tokens(model, tok, prompt, mlx_spec.NGramDrafter(), **opts)
            result[f"sampled_unsharded{i}_{seed}"] = tokens(reference, tok, prompt,
                                                            mlx_spec.NGramDrafter(), **opts)
    if not quick:  # a prompt cache over two turns, the first stopped mid-block by the caller
        for name, target_model in (("cache_turns", model), ("cache_turns_unsharded", reference)):
            cache = mlx_spec.make_cache(target_model)
            gen = mlx_spec.stream_generate(target_model, tok, PROMPTS[0], mlx_spec.NGramDrafter(),
                                           max_tokens=N, num_draft_tokens=3, prompt_cache=cache)
            seen = [next(gen).token for _ in range(7)]
            gen.close()
            turn2 = tokens(target_model, tok, [3, 4], mlx_spec.NGramDrafter(), num_draft_tokens=3,
                           prompt_cache=cache)
            plain = tokens(target_model, tok, PROMPTS[0] + seen + [3, 4], None)
            result[name] = [seen, turn2, plain]
    return result


def tree_auto(model, tok, prompt) -> tuple[list[int], int]:
    """n-gram trees with `auto` choosing how much of each tree to verify from what each shape
    paid (step timings, which differ between ranks). Rank 1 would always pick the first branch
    alone, so the ranks agree only if every rank takes rank 0's pick: tokens and tree steps.
    The draft length is held at its largest on every rank: left to auto, a loaded machine's
    timings could park drafting for the whole run, and then no tree is ever verified."""
    from mlx_spec.adaptive import AdaptiveK
    from mlx_spec.tree_shape import ShapeChoice

    real, choose = ShapeChoice.pick, AdaptiveK.choose
    if mx.distributed.init().rank() == 1:
        ShapeChoice.pick = lambda self: (real(self), 0)[1]
    AdaptiveK.choose = lambda self: (choose(self), (self.k_max, 1.0))[1]
    try:
        out = list(mlx_spec.stream_generate(model, tok, prompt, mlx_spec.NGramDrafter(min_n=1, branches=2),
                                            max_tokens=N))
    finally:
        ShapeChoice.pick, AdaptiveK.choose = real, choose
    return [r.token for r in out], out[-1].stats.tree_steps


def ahead_auto(model, tok, prompt) -> tuple[list[int], int, int]:
    """`auto` parking and probing on a fixed schedule (two plain steps, then a draft of 2),
    while the ranks' own guesses of whether the next step stays plain differ (rank 1: always,
    rank 0: never), as their timings may. A plain step queued ahead on one rank only, then taken
    back for a draft, would be a forward the other ranks never ran. Returns the tokens, the
    steps that drafted and the steps in all."""
    from mlx_spec.adaptive import AdaptiveK

    choose, parked_next = AdaptiveK.choose, AdaptiveK.parked_next
    steps = iter(range(10**6))
    AdaptiveK.choose = lambda self: (choose(self), (2 if next(steps) % 3 == 2 else 0, 1.0))[1]
    AdaptiveK.parked_next = lambda self: mx.distributed.init().rank() == 1
    try:
        out = list(mlx_spec.stream_generate(model, tok, prompt, mlx_spec.NGramDrafter(min_n=1),
                                            max_tokens=N))
    finally:
        AdaptiveK.choose, AdaptiveK.parked_next = choose, parked_next
    stats = out[-1].stats
    return [r.token for r in out], stats.drafted, stats.target_forwards


def traced(model, tok, prompt, drafter, **kw):
    out = list(mlx_spec.stream_generate(model, tok, prompt, drafter, max_tokens=N, trace=True,
                                        num_draft_tokens=3, **kw))
    return [r.token for r in out], [[t.proposed, t.accepted] for t in out[-1].stats.trace or []]


def run_head(model, tok, target: str, head: str, quick: bool) -> dict:
    """A head drafter reading layer taps: tokens and every step's proposal, on the sharded
    and the unsharded target (the same head weights on both)."""
    result = {}
    reference, _ = mlx_spec.load(target)
    for i, prompt in enumerate(PROMPTS[:1] if quick else PROMPTS):
        result[f"unsharded{i}"] = tokens(reference, tok, prompt, None)
        result[f"plain{i}"] = tokens(model, tok, prompt, None)
        for seed in (None,) if quick else (None, 1):
            opts = {} if seed is None else dict(temp=1.0, seed=seed)
            for name, m in (("head", model), ("head_unsharded", reference)):
                result[f"{name}{i}_{seed}"] = traced(m, tok, prompt, mlx_spec.load_drafter(head, m), **opts)
    return result


def run_v4(model, tok, target: str, mode: str) -> dict:
    """A DeepSeek-V4 target (mlx-vlm) with the DSpark stages of its checkpoint: plain, n-gram
    (greedy, and seeded sampled on a pipeline split) and DSpark tokens, and every DSpark step's proposal, on the
    sharded and the unsharded target. 12 drafts: verify blocks of 13 tokens, which the target feeds in pieces of 8."""
    reference, _ = mlx_spec.load(target)
    result = {"unsharded0": tokens(reference, tok, PROMPTS[0], None),
              "plain0": tokens(model, tok, PROMPTS[0], None),
              "ngram0": tokens(model, tok, PROMPTS[0], mlx_spec.NGramDrafter(), num_draft_tokens=3)}
    if mode == "pipeline":
        opts = dict(temp=1.0, seed=1, num_draft_tokens=3)
        result["sampled0_1"] = tokens(model, tok, PROMPTS[0], mlx_spec.NGramDrafter(), **opts)
        result["sampled_unsharded0_1"] = tokens(reference, tok, PROMPTS[0], mlx_spec.NGramDrafter(), **opts)
    for name, m in (("dspark", model), ("dspark_unsharded", reference)):
        d = mlx_spec.load_drafter(target, m, kind="dspark", num_speculative_tokens=12)
        out = list(mlx_spec.stream_generate(m, tok, PROMPTS[0], d, max_tokens=N, trace=True,
                                            num_draft_tokens=12))
        result[name] = [[r.token for r in out], [[t.proposed, t.accepted] for t in out[-1].stats.trace]]
    return result


def run_mtp(model, tok, target: str) -> dict:
    """A target's own MTP module drafting (it reads the target's final-norm input through the
    taps): plain and MTP tokens, greedy and seeded sampled, and every MTP step's proposal, on
    the sharded and the unsharded target; greedy again with the head reading the last layer's
    output instead (`last_layer`, as DeepSeek-V4's MTP block does), on a pipeline split a
    tap of rank 0's stage that rank 1 receives."""
    from mlx_spec.drafters.mtp import load_mtp

    reference, _ = mlx_spec.load(target)
    result = {"unsharded0": tokens(reference, tok, PROMPTS[0], None),
              "plain0": tokens(model, tok, PROMPTS[0], None)}
    for seed in (None, 1):
        opts = {} if seed is None else dict(temp=1.0, seed=seed)
        for name, m in (("mtp", model), ("mtp_unsharded", reference)):
            d = mlx_spec.load_drafter(target, m, kind="mtp")
            result[f"{name}_{seed}"] = traced(m, tok, PROMPTS[0], d, **opts)
    for name, m in (("mtp_last", model), ("mtp_last_unsharded", reference)):
        d = load_mtp(target, m, hidden_state="last_layer")
        result[name] = traced(m, tok, PROMPTS[0], d)
        result[name + "_taps"] = list(d.taps)
    return result


if __name__ == "__main__":
    main()
