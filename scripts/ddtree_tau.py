"""Block drafters: tau of chains against DDTree-style trees (`tree_budget`), two ways.

    python scripts/ddtree_tau.py [--tokens 120] [--runs 200] [--trials 4000] [--only selector]

1. Through the decode loop, with the synthetic DFlash heads of tests/test_dflash.py
   (random weights; tau = tokens per target forward, as `stats.tau` there):
   * echo: the tiny qwen3 "echo" target with the copy-the-anchor head (block 16), greedy;
   * v8:   the 8-token target with a random 1-layer head (block 4, k = 3), greedy and
           sampled (temp 1, `--runs` seeded runs of 5 tokens).
2. DSpark heads with a Markov head (tests/test_dspark.py): the echo target's bigram head,
   greedy; the bigram head on the 8-token target, sampled. Their trees are the best
   paths of the Markov chain.
3. DFlash2 heads (tests/test_dflash2.py): the echo target with the copy-the-anchor head
   whose candidate selector has no edges (block 8), greedy; the random head on the
   8-token target, sampled. Their trees are the best paths of the selector's chain.
4. An ideal block drafter (NumPy only, as scripts/block_draft_modes.py): random Markov
   targets over V tokens whose rows mix sharp and flat, the drafter's q_j the exact
   marginal j + 1 steps ahead, the tree `block_tree.best_prefixes` over them. Greedy
   targets follow their argmax; sampled ones draw each token from the row, and a tree
   keeps a draw when it is one of the current node's children (SpecInfer's rule for
   point masses accepts child c with probability p(c)). Expected tau over `--trials`.
   A greedy target follows its argmax path while the drafter knows only the sampled
   marginals (a proxy for a head trained on sampled text): it shows what branching
   costs where the argmax chain is usually right. Sampled chains are shown both as
   argmax point masses (what the tree's first branch is) and drawn from q_j with
   their q (`sample_drafts=True`, the block drafters' default).

Chains verify k + 1 rows, trees budget + 1: compare a tree with the chain of equal k.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT)]


def loop_tau(tokens: int, runs: int) -> None:
    import dflash_synth  # noqa: F401 (tests/ on the path)
    import lossless as L
    from mlx_spec.heads import load_drafter
    from runs import spec_run
    from test_dflash import FLASH_PROMPT, PROMPT, V8, make_head, target

    class Factory:  # sampled_flash takes a pytest tmp_path_factory
        def mktemp(self, name):
            return Path(tempfile.mkdtemp(prefix=name))

    tmp = Path(tempfile.mkdtemp())
    model, _ = target("qwen3-echo")
    head, _, _ = make_head(tmp, "qwen3-echo", copy=True)
    print(f"echo target, copy head (block 16), greedy, {tokens} tokens: tau")
    for k, budget in [(4, None), (4, 4), (8, None), (8, 8), (15, None), (15, 8), (15, 16), (16, None)]:
        _, st = spec_run(model, load_drafter(head, model, tree_budget=budget), PROMPT, tokens, min(k, 15))
        label = f"chain k={min(k, 15):2d}" if budget is None else f"tree budget {budget:2d}, depth <= {k:2d}"
        print(f"  {label:28s} {st.tau:6.3f}  (tree steps {st.tree_steps}/{st.target_forwards})")

    from test_dflash import sampled_flash

    model, head, _ = sampled_flash(Factory())
    print(f"v8 target, random head (block 4, k = 3): tau, greedy {tokens} tokens | sampled "
          f"{runs} runs x 5 tokens")
    for budget in (None, 3, 4, 6, 8, 12, 16):
        _, st = spec_run(model, load_drafter(head, model, tree_budget=budget), FLASH_PROMPT, tokens, 3)
        d = load_drafter(head, model, tree_budget=budget)
        r = L.sampled_runs(model, FLASH_PROMPT, lambda: d, runs, max_tokens=5, k=3, vocab=V8, temp=1.0)
        steps = sum(len(t) for t in r.traces)
        sampled = sum(t.accepted + 1 for tr in r.traces for t in tr) / max(steps, 1)
        label = "chain k=3" if budget is None else f"tree budget {budget}"
        print(f"  {label:28s} {st.tau:6.3f} | {sampled:6.3f}")


def spark_tau(tokens: int, runs: int) -> None:
    """DSpark heads with a Markov head (trees: the best paths of the Markov chain)."""
    import lossless as L
    import test_dspark as T
    from mlx_spec.heads import load_drafter
    from runs import spec_run

    class Factory:
        def mktemp(self, name):
            return Path(tempfile.mkdtemp(prefix=name))

    tmp = Path(tempfile.mkdtemp())
    model, _, _ = T.echo_target()
    head, _ = T.make_head(tmp)  # its Markov term is the target's own bigram: usually right
    print(f"DSpark, echo target, bigram Markov head (block 7), greedy, {tokens} tokens: tau")
    for k, budget in [(3, None), (3, 3), (7, None), (7, 7), (7, 12), (7, 16)]:
        _, st = spec_run(model, load_drafter(head, model, tree_budget=budget), T.PROMPT, tokens, k)
        label = f"chain k={k}" if budget is None else f"tree budget {budget:2d}, depth <= {k}"
        print(f"  {label:28s} {st.tau:6.3f}  (tree steps {st.tree_steps}/{st.target_forwards})")
    model, head, _ = T.bigram_spark(Factory())
    print(f"DSpark, 8-token target, bigram Markov head (block 3, k = 3): tau, sampled {runs} runs x 5 tokens")
    for budget in (None, 3, 4, 6, 8):
        d = load_drafter(head, model, tree_budget=budget)
        r = L.sampled_runs(model, T.SPARK_PROMPT, lambda: d, runs, max_tokens=5, k=3, vocab=T.V8, temp=1.0)
        steps = sum(len(t) for t in r.traces)
        sampled = sum(t.accepted + 1 for tr in r.traces for t in tr) / max(steps, 1)
        print(f"  {'chain k=3' if budget is None else f'tree budget {budget}':28s} {sampled:6.3f}")


def selector_tau(tokens: int, runs: int) -> None:
    """DFlash2 heads (trees: the best paths of the candidate selector's chain)."""
    import lossless as L
    import test_dflash2 as T
    from mlx_spec.heads import load_drafter
    from runs import spec_run

    tmp = Path(tempfile.mkdtemp())
    model = T.target("qwen3-echo")[0]
    head, _ = T.head(tmp, identity=True)
    print(f"DFlash2, echo target, copy head (block 8), greedy, {tokens} tokens: tau")
    for k, budget in [(3, None), (3, 3), (7, None), (7, 7), (7, 12), (7, 16)]:
        _, st = spec_run(model, load_drafter(head, model, tree_budget=budget), T.PROMPT, tokens, k)
        label = f"chain k={k}" if budget is None else f"tree budget {budget:2d}, depth <= {k}"
        print(f"  {label:28s} {st.tau:6.3f}  (tree steps {st.tree_steps}/{st.target_forwards})")
    model, head = T.sampled_head(tmp)
    print(f"DFlash2, 8-token target, random head (block 4, k = 3): tau, sampled {runs} runs x 5 tokens")
    for budget in (None, 3, 4, 6, 8):
        d = load_drafter(head, model, tree_budget=budget)
        r = L.sampled_runs(model, [1, 2, 3], lambda: d, runs, max_tokens=5, k=3, vocab=T.V8, temp=1.0)
        steps = sum(len(t) for t in r.traces)
        sampled = sum(t.accepted + 1 for tr in r.traces for t in tr) / max(steps, 1)
        print(f"  {'chain k=3' if budget is None else f'tree budget {budget}':28s} {sampled:6.3f}")


def markov_tau(vocab: int, trials: int) -> None:
    from mlx_spec.drafters.block_tree import best_prefixes

    k = 8
    print(f"ideal block drafter, Markov targets over {vocab} tokens, depth <= {k}: tau greedy / sampled")
    shapes = [("chain k=4", 4, None), ("tree 4", k, 4), ("chain k=8", 8, None), ("tree 8", k, 8),
              ("chain k=16", 16, None), ("tree 16", k, 16)]
    print("  mean top-1 p | " + " | ".join(s[0] for s in shapes) + " | drawn chain k=8 (sampled)")
    for mu in (0.5, 1.5, 2.5, 3.5):
        rng = np.random.default_rng(0)
        sharp = np.exp(rng.normal(mu, 1.0, size=(vocab, 1)))
        logits = rng.normal(size=(vocab, vocab)) * sharp
        P = np.exp(logits - logits.max(1, keepdims=True))
        P /= P.sum(1, keepdims=True)
        cells = []
        for _, depth, budget in shapes:
            g = s = 0.0
            for y in range(vocab):
                m, q = np.eye(vocab)[y], []
                for _ in range(depth):
                    m = m @ P
                    q.append(m)
                logq = np.log(np.maximum(np.array(q), 1e-300))
                if budget is None:  # the chain: each position's argmax
                    nodes = {tuple(np.argmax(logq[: d + 1], 1)) for d in range(depth)}
                else:
                    order = np.argsort(-logq, 1)[:, :budget]
                    vals = np.take_along_axis(logq, order, 1)
                    nodes = {tuple(order[np.arange(len(r)), list(r)]) for r in best_prefixes(vals, budget)}
                path, prev = (), y  # greedy: the target's argmax path
                while path + (int(P[prev].argmax()),) in nodes:
                    path += (int(P[prev].argmax()),)
                    prev = path[-1]
                g += len(path) + 1
                n = max(trials // vocab, 1)
                cum = np.cumsum(P, 1)
                for _ in range(n):  # sampled: the target draws; a draw among the children is kept
                    path, prev = (), y
                    while True:
                        x = int(min(np.searchsorted(cum[prev], rng.random()), vocab - 1))
                        if path + (x,) not in nodes:
                            break
                        path += (x,)
                        prev = x
                    s += (len(path) + 1) / n
            cells.append(f"{g / vocab:.2f} / {s / vocab:.2f}")
        drawn = 0.0  # the chain default under sampling: d_j ~ q_j, kept w.p. min(1, p/q)
        for y in range(vocab):
            m, n = np.eye(vocab)[y], max(trials // vocab, 1)
            prev, alive, count = np.full(n, y), np.ones(n, bool), np.zeros(n)
            for _ in range(8):
                m = m @ P
                d = (rng.random(n)[:, None] > np.cumsum(m)[None]).sum(1).clip(0, vocab - 1)
                alive &= rng.random(n) < np.minimum(1.0, P[prev, d] / m[d])
                count += alive
                prev = d
            drawn += (count.mean() + 1) / vocab
        print(f"  {P.max(1).mean():.2f} | " + " | ".join(cells) + f" | {drawn:.2f}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=120)
    ap.add_argument("--runs", type=int, default=200)
    ap.add_argument("--trials", type=int, default=4000)
    ap.add_argument("--vocab", type=int, default=50)
    ap.add_argument("--only", choices=["loop", "spark", "selector", "markov"], default=None,
                    help="run one section")
    args = ap.parse_args()
    sections = {"loop": lambda: loop_tau(args.tokens, args.runs),
                "spark": lambda: spark_tau(args.tokens, args.runs),
                "selector": lambda: selector_tau(args.tokens, args.runs),
                "markov": lambda: markov_tau(args.vocab, args.trials)}
    for name, run in sections.items():
        if args.only in (None, name):
            run()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
