"""Draft-model rows of a batch drafting together: one batched forward per depth.

The rows' caches are merged for the step (mlx-lm's left-padded `BatchKVCache`); their
new inputs (queued tokens + y, and the row's lookup guess when it has one: see
`DraftModelDrafter.follow`), ragged, go in right-padded. After the first forward each
row's head is known (its first token; for a guided row the guess as far as the draft
agrees, and one more); the padding and every row's refused guess rows are rolled into
the left padding, and one-token forwards over the rows chain the rest of the drafts.
Each row's new entries, up to its own k - 1 drafts, are written back into its own
cache, which is left as its own `propose` leaves it. A row's chain ends where its own would
(`min_confidence`: after its first unsure token, one host read a depth); the other rows go on,
and the forwards stop when every row has ended. `keys`: each row's random key
(None: greedy); split per draw as MLX's global stream is, so a seeded row draws what it
would alone.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache

from ..cache import Checkpoint
from ..overlap import overlapped
from ..sampling import Sampling
from .base import Draft, confidence, pick


def propose_together(drafters: list, ys: list[int], ks: list[int], samplings: list[Sampling],
                     keys: list) -> list[Draft]:
    first = drafters[0]
    for d in drafters:  # a long backlog (the prompt) alone, not padded into every row
        d._catch_up()
    guesses = [d._guess(y, k) for d, y, k in zip(drafters, ys, ks)]
    fed = [d._pending + [y] for d, y in zip(drafters, ys)]
    for d, f, k in zip(drafters, fed, ks):
        d._ckpt, d._fed, d._pending, d._rows, d._k = Checkpoint(d.model, d.cache), f, [], None, k
    inputs = [f + g for f, g in zip(fed, guesses)]
    sizes = [d.cache[0].offset for d in drafters]
    L, keys = max(map(len, inputs)), list(keys)

    def draw(i: int):
        """Row i's next random key (None: greedy)."""
        if keys[i] is None:
            return None
        keys[i], sub = mx.random.split(keys[i])
        return sub

    batch = [BatchKVCache.merge(list(layer)) for layer in zip(*(d.cache for d in drafters))]
    x = mx.array([row + row[-1:] * (L - len(row)) for row in inputs], mx.uint32)
    run, place = first.batch_head(drafters)
    with overlapped(first.model):
        out = run(x, batch)
    heads, qs, ended = [], [], []  # each row's first tokens (an array), their q rows (lists)
    for i, (d, f, g, s) in enumerate(zip(drafters, fed, guesses, samplings)):
        if g:
            rows = place(i, out[i, len(f) - 1 : len(f) + len(g)])
            head, q = d.follow(rows, g, s, lambda: draw(i))
            head, q, unsure = d._until_unsure(rows, head, q)
            heads.append(mx.array(head, mx.uint32))
            qs.append([] if q is None else list(q))
        else:
            rows = place(i, out[i, len(f) - 1])
            t, q = pick(rows, s, key=draw(i))
            heads.append(t.astype(mx.uint32).reshape(1))
            qs.append([] if q is None else [q])
            unsure = None if d.min_confidence is None else confidence(rows, t, q)  # read below, at once
        ended.append(unsure)
    mx.eval([e for e in ended if isinstance(e, mx.array)])
    ended = [e.item() < d.min_confidence if isinstance(e, mx.array) else bool(e) for d, e in zip(drafters, ended)]
    # the padding and the refused guesses' rows go to the left padding
    right = [L - len(row) + len(g) + 1 - h.size for row, g, h in zip(inputs, guesses, heads)]
    left = [max(sizes) - s + r for s, r in zip(sizes, right)]
    for c in batch:
        c.prepare(right_padding=right)
        c.finalize()
    rest = [0 if e else k - h.size for e, k, h in zip(ended, ks, heads)]  # drafts still to come
    steps, last = [], mx.stack([h[-1] for h in heads])  # steps: each depth's [B] tokens
    done = [0] * len(drafters)  # each row's drafts after its head
    while any(n < r for n, r in zip(done, rest)):
        live = [n < r for n, r in zip(done, rest)]
        with overlapped(first.model):
            logits = place(None, run(last[:, None], batch)[:, -1])
        drawn = []  # each row's token and its q (a row that has ended draws nothing)
        if all(s.greedy for s in samplings):  # one argmax over the rows
            last = mx.argmax(logits, axis=-1).astype(mx.uint32)
            drawn = [(last[i], None) for i in range(len(live))]
        else:
            for i, s in enumerate(samplings):
                t, q = pick(logits[i], s, key=draw(i)) if live[i] else (last[i], None)
                drawn.append((t.astype(mx.uint32), q))
                qs[i] += [] if q is None else [q]
            last = mx.stack([t for t, _ in drawn])
        steps.append(last)
        done = [n + v for n, v in zip(done, live)]
        sure = [None if not (v and n < r and d.min_confidence is not None) else confidence(logits[i], t, q)
                for i, (d, v, n, r, (t, q)) in enumerate(zip(drafters, live, done, rest, drawn))]
        if any(c is not None for c in sure):  # rows whose chain ends after this token
            mx.eval([c for c in sure if c is not None])
            rest = [n if c is not None and c.item() < d.min_confidence else r
                    for d, n, r, c in zip(drafters, done, rest, sure)]
    more = mx.stack(steps, axis=1) if steps else None  # [B, depths]
    end, depths = batch[0].size(), len(steps)
    drafts = []
    for i, d in enumerate(drafters):
        stop = end - (depths - done[i])  # this row fed its own drafts but its last, no more
        for c, row in zip(batch, d.cache):
            row.keys = mx.contiguous(c.keys[i : i + 1, :, left[i] : stop])
            row.values = mx.contiguous(c.values[i : i + 1, :, left[i] : stop])
            row.offset = stop - left[i]
        d._main = heads[i] if not done[i] else mx.concatenate([heads[i], more[i, : done[i]]])
        d._k = d._main.shape[0]
        drafts.append(Draft(d._main, mx.stack(qs[i]) if qs[i] else None))
    return drafts
