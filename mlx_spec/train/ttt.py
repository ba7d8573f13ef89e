"""The EAGLE-3 training forward: training-time test (TTT) over the drafter's own head.

One sequence x_0 .. x_{T-1} the target has read gives, at every position t, the
target's taps (the head's step-0 feature `fc(taps_t)`) and its next-token
distribution. Training-time test unrolls `steps` head steps at every base
position t at once, exactly as the drafter chains them at inference
(mlx_spec.drafters.eagle.drafter):

* step 0 at base t reads the embedding of x_{t+1} and the target's feature of
  t, and predicts x_{t+2};
* step i > 0 at base t reads the embedding of x_{t+i+1} (the token the target
  kept: a draft is only worth anything while it equals the target's) and the
  head's own feature from step i - 1, and predicts x_{t+i+2}.

At inference step i of base t sits at position t + i and attends to the real
positions 0..t and to its own chained positions t+1..t+i. Here every step runs
all bases in one call of the head (`Eagle3Head.__call__`, the inference
forward itself) through `_StepKeys`, a cache that keeps each step's keys side
by side: RoPE offset i, and a mask that lets base t see step 0's keys at 0..t
(causal) and step j's key at t for 1 <= j <= i (the diagonal). Both
computations are the same numbers, which tests/test_train_ttt.py checks.

Loss (EAGLE-3, arXiv 2503.01840; SpecForge `core/eagle3.py`): at each step,
the cross-entropy of the head's log-probabilities over the draft vocabulary
against the target's probabilities restricted to it, on the rows whose
predicted token is a response token and whose target top-1 lies in the draft
vocabulary; step i weighs 0.8^i. Also returned: per step, how often the
head's top-1 equals the target's (the acceptance a greedy chain would see if
all earlier drafts were kept).
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

STEP_DECAY = 0.8  # weight of unrolled step i: 0.8 ** i (EAGLE-3 / SpecForge)


class _StepKeys:
    """A head-layer cache for training-time test: step i's keys appended after steps 0..i-1.

    `offset` is the RoPE position of base 0 in the current step (= the step
    index), so base t of step i is rotated to position t + i, as at inference.
    """

    def __init__(self):
        self.offset = 0
        self.keys = self.values = None

    def update_and_fetch(self, k: mx.array, v: mx.array):
        if self.keys is None:
            self.keys, self.values = k, v
        else:
            self.keys = mx.concatenate([self.keys, k], axis=2)
            self.values = mx.concatenate([self.values, v], axis=2)
        return self.keys, self.values


def step_mask(n: int, i: int) -> mx.array:
    """[n, (i + 1) n] bool: base t sees step 0 at 0..t and step j (1..i) at t."""
    rows = mx.arange(n)[:, None]
    causal = mx.arange(n)[None] <= rows
    diag = mx.arange(n)[None] == rows
    return mx.concatenate([causal] + [diag] * i, axis=1)


@dataclass
class Batch:
    """One training sequence, everything the loss needs (no gradient flows into it).

    tokens [T] int; taps {tap id: [T, H_t]}; target_logits [T, V_d] (the target's
    logits at each position, draft-vocabulary columns); target_top [T] the
    target's greedy token at each position as a draft id, or -1 when it is not
    in the draft vocabulary; prompt_len: rows predicting a token before it
    carry no loss.
    """

    tokens: mx.array
    taps: dict
    target_logits: mx.array
    target_top: mx.array
    prompt_len: int


def unroll(head, embed, batch: Batch, tap_ids, steps: int) -> list[mx.array]:
    """Head logits [n, V_d] of each unrolled step (n = T - 1 base positions)."""
    T = batch.tokens.shape[0]
    n = T - 1
    g = head.features(batch.taps, tap_ids)[None, :n]  # [1, n, H]
    caches = [_StepKeys() for _ in head.layers]
    out = []
    for i in range(steps):
        idx = mx.minimum(mx.arange(n) + i + 1, T - 1)  # x_{t+i+1}; past the end: masked rows
        emb = embed(batch.tokens[idx][None])
        for c in caches:
            c.offset = i
        g, h = head(emb, g, caches, mask=step_mask(n, i))
        out.append(head.lm_head(h)[0])
    return out


def row_weights(batch: Batch, step: int) -> mx.array:
    """[n] 1.0 where step `step` at base t carries loss: x_{t+step+2} exists, is a response
    token, and the target's top-1 there is in the draft vocabulary."""
    T = batch.tokens.shape[0]
    n = T - 1
    pos = mx.arange(n) + step + 1  # the target position whose next-token distribution is the label
    ok = (pos + 1 < T) & (pos + 1 >= batch.prompt_len)
    top = batch.target_top[mx.minimum(pos, T - 1)]
    return (ok & (top >= 0)).astype(mx.float32)


def loss_terms(head, embed, batch: Batch, tap_ids, steps: int):
    """(weighted loss, [per-step cross-entropy], [per-step top-1 agreement], [rows per step])."""
    T = batch.tokens.shape[0]
    n = T - 1
    logits = unroll(head, embed, batch, tap_ids, steps)
    total = mx.array(0.0)
    ces, accs, counts = [], [], []
    for i, lg in enumerate(logits):
        pos = mx.minimum(mx.arange(n) + i + 1, T - 1)
        p = mx.softmax(batch.target_logits[pos].astype(mx.float32), axis=-1)  # [n, V_d]
        logp = lg - mx.logsumexp(lg, axis=-1, keepdims=True)
        w = row_weights(batch, i)
        count = mx.maximum(w.sum(), 1.0)
        ce = -((p * logp).sum(-1) * w).sum() / count
        agree = ((mx.argmax(lg, axis=-1) == batch.target_top[pos]).astype(mx.float32) * w).sum() / count
        total = total + (STEP_DECAY**i) * ce
        ces.append(ce)
        accs.append(agree)
        counts.append(w.sum())
    return total, ces, accs, counts


def loss_fn(head, embed, batch: Batch, tap_ids, steps: int) -> tuple:
    """`nn.value_and_grad`-ready: (loss, per-step agreements) with the loss first."""
    total, _, accs, _ = loss_terms(head, embed, batch, tap_ids, steps)
    return total, mx.stack(accs)


def draft_index(d2t: mx.array, vocab: int) -> mx.array:
    """[vocab] int32: the draft id of each target id, -1 outside the draft vocabulary (t2d)."""
    idx = mx.full((vocab,), -1, mx.int32)
    return idx.at[d2t.astype(mx.int32)].add(mx.arange(d2t.shape[0], dtype=mx.int32) + 1)


def target_batch(model, taps, tokens, prompt_len: int, d2t: mx.array, index: mx.array) -> Batch:
    """Run the frozen target over `tokens` once (taps installed by the caller) and keep what
    the loss needs: nothing here is differentiated (`mx.stop_gradient`) and all is evaluated,
    so the target's graph is freed before the head's step."""
    x = mx.array(tokens, mx.uint32)
    logits = model(x[None])[0]  # [T, V]
    got = taps.read()
    tap = {k: mx.stop_gradient(v) for k, v in got.items()}
    top = index[mx.argmax(logits, axis=-1)]
    tl = mx.stop_gradient(logits[:, d2t])
    mx.eval(tl, top, list(tap.values()))
    return Batch(x, tap, tl, top, int(prompt_len))
