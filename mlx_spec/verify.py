"""The target side of the loop: prefill a row, then one verify forward per step for all rows.

`verify` builds the target forward over every row's `[y, d0 .. d(k-1)]` (right-
padded to the longest), or over one row's draft tree, and each row's acceptance,
as one lazy graph and reads all results at once (the step's host sync). Then each
row's cache keeps exactly its own accepted prefix: `Checkpoint` for a single row
(any cache kind), `BatchCheckpoint` for a batch (KV, window and recurrent layers).
A chain and a tree differ only in a few pieces (`Chain`, `Tree`: the forward, the
acceptance arrays, the walk over them); a step that fails half-way leaves the
caches as they were before it.

Logits processors (mlx-lm's `logits_processors`: repetition penalties, logit
bias) are applied to every verified row with that row's own history (the
tokens before it, the drafted ones included), so acceptance sees the
distribution plain decoding would have used: lossless for any processor
that depends only on the history and the logits.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import mlx.core as mx
from mlx_lm.models.cache import KVCache, QuantizedKVCache, RotatingKVCache

from . import acceptance, tree
from .batch_cache import checkpoint
from .cache import WindowKVCache
from .drafters.base import Draft, vocab_size
from .overlap import overlapped


@dataclass
class Verdict:
    proposed: list[int]  # the drafts the target examined (a confidence cut may shorten the draft)
    n: int  # how many of them the target kept
    token: int  # the target's own next token (correction or bonus): the new y
    taps: dict | None  # target hidden states at the kept inputs [y, d0 .. d(n-1)]
    logprobs: mx.array  # [n + 1, V] the target's log-probabilities of the emitted tokens (lazy)
    size: int  # rows drafted and verified (>= len(proposed))
    depth: int | None = None  # a tree's levels (None: a chain, its size)

    @property
    def emitted(self) -> list[int]:
        return self.proposed[: self.n] + [self.token]


def log_softmax(logits: mx.array) -> mx.array:
    if logits.dtype != mx.float32:
        logits = logits.astype(mx.float32)
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def processed(row, logits: mx.array, inputs: mx.array) -> mx.array:
    """A row's logits [T, V] after `inputs` [T], through its logits processors."""
    if not row.req.logits_processors:
        return logits
    out = []
    for i in range(logits.shape[0]):
        seen = mx.concatenate([row.history, inputs[: i + 1]])
        line = logits[i : i + 1]
        for process in row.req.logits_processors:
            line = process(seen, line)
        out.append(line)
    return mx.concatenate(out)


def prefill(model, row, limit: int | None = None) -> tuple[int, mx.array] | None:
    """Feed up to `limit` more prompt tokens of `row` into its own cache; when the prompt
    is all in, return the row's first token and its log-probabilities (else None).

    All but the last prompt token go through in chunks of `prefill_step_size`
    whose logits are never computed; the LM head runs for the last position
    only, as in mlx-lm. The last call samples the row's first token.
    """
    req, prompt = row.req, row.req.prompt
    total, budget = len(prompt), limit or len(prompt)
    if row.consumed == 0:
        row.progress(0, total)
    while row.consumed < total - 1 and budget > 0:
        tic = time.perf_counter()
        chunk = list(prompt[row.consumed : min(row.consumed + req.prefill_step_size, total - 1,
                                                row.consumed + budget)])
        model(mx.array(chunk, mx.uint32)[None], cache=row.cache)
        row.prompt_taps.append(row.read_taps(0, len(chunk)))
        req.quantize_cache(row.cache)
        mx.eval([c.state for c in row.cache], row.prompt_taps[-1])
        row.fed(chunk)
        row.prefill_time[0] += len(chunk)
        row.prefill_time[1] += time.perf_counter() - tic
        budget -= len(chunk)
        row.progress(row.consumed, total)
        mx.clear_cache()
    if row.consumed < total - 1:
        return None
    last = mx.array(list(prompt[-1:]), mx.uint32)
    logits = processed(row, model(last[None], cache=row.cache)[0], last)
    row.prompt_taps.append(row.read_taps(0, 1))
    row.seed_rng(0)
    y = req.sampling.sample(logits[-1]).item()
    row.fed(prompt[-1:])
    row.progress(total, total)
    return y, log_softmax(logits[-1])


TOGETHER_MAX = 160  # longer prompts are read one by one (on a 2-core CPU, at 256 tokens together no longer paid)


def fresh(row) -> bool:
    """Whether `row` can be prefilled together with others (`prefill_together`): nothing read
    yet into a fresh cache of plain KV layers that stays unquantized while the prompt goes in
    (no `kv_bits`), no hidden-state taps, and a prompt that fits one prefill chunk."""
    req = row.req
    return (row.consumed == 0 and row.taps is None and req.kv_bits is None
            and len(req.prompt) <= min(req.prefill_step_size, TOGETHER_MAX)
            and all(type(c) is KVCache and c.offset == 0 for c in row.cache))


def prefill_together(model, rows: list) -> list[tuple[int, mx.array]]:
    """`prefill` of several `fresh` rows in two batched forwards (as mlx-lm's batch generator
    prefills): their prompts but the last token left-padded into one batch cache, then the
    last tokens; each row's own cache then holds its prompt, as `prefill` would leave it.
    Short prompts read together run the matmuls on B times the rows at once. The rows'
    progress callbacks are the caller's to call (before and after), one row at a time."""
    from mlx_lm.models.cache import BatchKVCache

    tic, heads = time.perf_counter(), [list(r.req.prompt[:-1]) for r in rows]
    width = max(map(len, heads))
    batch = [BatchKVCache([width - len(h) for h in heads]) for _ in rows[0].cache]
    if width:
        model(mx.array([[0] * (width - len(h)) + h for h in heads], mx.uint32), cache=batch)
        mx.eval([c.state for c in batch])
    last = mx.array([[r.req.prompt[-1]] for r in rows], mx.uint32)
    logits = model(last, cache=batch)[:, -1]
    out = []
    for i, row in enumerate(rows):
        own = [c.extract(i) for c in batch]
        for mine, filled in zip(row.cache, own):
            mine.state = filled.state  # the row's own layer objects (its checkpoint holds them)
        row.fed(heads[i])
        line = processed(row, logits[i : i + 1], last[i])
        row.seed_rng(0)
        y = row.req.sampling.sample(line[-1]).item()
        row.fed(row.req.prompt[-1:])
        out.append((y, log_softmax(line[-1])))
    mx.eval([c.state for row in rows for c in row.cache])
    seconds, read = time.perf_counter() - tic, max(sum(map(len, heads)), 1)
    for row, head in zip(rows, heads):  # each row's share of the time, by its tokens
        row.prefill_time[0] += len(head)
        row.prefill_time[1] += seconds * len(head) / read
    mx.clear_cache()
    return out


class ArrayMask(tree.LayerView):
    """A KV layer seen by one multi-token forward that asks for its causal mask as an array.

    Given the string "causal", MLX's attention on the CPU builds the mask again inside every
    layer (a few small operations each, 30 layers: about a tenth of a 5-token verify in the
    GPU-like regime of scripts/overhead.py); an array is built once per forward and shared
    by every layer. Same values, bit for bit (tested)."""

    def make_mask(self, N: int, *args, **kwargs):
        return self.inner.make_mask(N, *args, **{**kwargs, "return_array": True})


ARRAY_MASKS = True  # False: let layers build "causal" themselves (scripts/overhead.py's "before")
_MASKED_KINDS = (KVCache, QuantizedKVCache, RotatingKVCache, WindowKVCache)  # (batch caches: arrays already)


def _masked(cache: list) -> list:
    """`cache` with its plain, quantized and window KV layers asking for array masks."""
    if not ARRAY_MASKS:
        return cache
    return [ArrayMask(c) if type(c) in _MASKED_KINDS else c for c in cache]


class Chain:
    """A chain block's pieces (`[y, d0 .. d(k-1)]` per row, any rows, any cache kind): the fast
    path. A plain forward; `acceptance.accept`, with the drafts' q and confidence cuts; the
    kept rows are a prefix, which the checkpoint keeps."""

    depth = None

    def forward(self, model, cache, inputs):
        return model(inputs, cache=_masked(cache) if inputs.shape[1] > 1 else cache)

    def accept(self, logits, d: Draft, sampling) -> list[mx.array]:
        n, nxt = acceptance.accept(logits, d.tokens, d.q, sampling, d.length)
        return [d.tokens, mx.stack([nxt, n, mx.array(d.size) if d.length is None else d.length])]

    def walk(self, read: list, sampling):
        """(drafts examined, drafts kept, next token, kept block rows) from `accept`'s arrays, read."""
        proposed, (nxt, n, length) = read
        return proposed[:length], n, nxt, slice(0, n + 1)


class Tree(Chain):
    """A row's draft tree (`mlx_spec.tree`, plain KV layers): the forward with the tree's mask
    and depth positions, `tree.draws` then `tree.walk`; the kept path's cache rows are
    gathered into place after the walk (`tree.compact`, `tree.compact_rows` in a batch)."""

    def __init__(self, cache, draft: Draft):
        self.parents, self.cache, self.base = list(draft.parents), cache, cache[0].offset
        self.depth = max(tree.depths(self.parents))

    def forward(self, model, cache, inputs):
        return tree.forward(model, cache, inputs[0], self.parents)[None]

    def accept(self, logits, d: Draft, sampling) -> list[mx.array]:
        return [d.tokens, *tree.draws(logits, d.tokens, self.parents, sampling, d.q)]

    def walk(self, read: list, sampling):
        path, nxt = tree.walk(self.parents, read[0], read[1:], sampling.greedy)
        return [read[0][j] for j in path], len(path), nxt, [0] + [j + 1 for j in path]


CHAIN = Chain()


def _forward(model, cache: list, blocks: list, inputs: list, drafts: list):
    """Logits [B, T, V] of the step's one target forward: chains, one row's tree, or a batch
    with trees (chains in it are trees of one branch)."""
    if all(b is CHAIN for b in blocks):
        return CHAIN.forward(model, cache, mx.stack(inputs))
    if len(blocks) == 1:
        return blocks[0].forward(model, cache, inputs[0][None])
    parents = [d.parents if d.parents is not None else tuple(range(-1, d.size - 1)) for d in drafts]
    return tree.forward_rows(model, cache, mx.stack(inputs), parents)


def padded_width(rows: list, drafts: list[Draft], cache: list) -> int:
    """The width of the step's block: `[y, d0 .. d(k-1)]`, or for a lone row's chain over plain
    KV layers, the cheaper wider width its policy's costs name (`CostModel.padded`). Filler
    rows (copies of y) are computed and never read: acceptance, taps and the cache keep
    only the block's own rows. (Not in batches, whose widths their own curve prices, nor
    over window, quantized or recurrent layers, which a filler could evict from or advance.)"""
    T = 1 + max(d.size for d in drafts)
    if len(rows) > 1 or drafts[0].parents is not None or T == 1:
        return T
    widths = getattr(getattr(rows[0].lengths, "costs", None), "widths", None)
    if widths is None or T > len(widths) or not all(type(c) is KVCache for c in cache):
        return T
    return widths[T - 1]


def in_vocab(drafts: list[Draft], V: int) -> list[Draft]:
    """The drafts as the target reads them: ids clamped into its vocabulary of V. An id past
    the embedding table would be read unchecked by MLX (a crash, or garbage); one that was
    out of range is refused after the step's read (`refuse_outside`). A q over another
    vocabulary is refused now."""
    for d in drafts:
        if d.q is not None and d.q.shape[-1] != V:
            raise ValueError(f"the drafter's q has {d.q.shape[-1]} probabilities a token, the target's vocabulary "
                             f"{V}: a Draft's q must be a distribution over the target's token ids")
    return [Draft(mx.minimum(d.tokens.astype(mx.uint32), V - 1), d.q, d.length, d.parents) for d in drafts]


def refuse_outside(tokens: list[int], V: int) -> None:
    bad = [t for t in tokens if not 0 <= t < V]
    if bad:
        raise ValueError(f"the drafter proposed token id {bad[0]}, outside the target's vocabulary (0..{V - 1}): "
                         "a drafter must propose target token ids (a draft over another tokenizer needs its "
                         "ids mapped to the target's)")


def verify(model, cache: list, rows: list, drafts: list[Draft]) -> list[Verdict]:
    """One target forward over every row's block, a chain or a tree; each keeps what it accepted."""
    single = len(rows) == 1  # (a lone row's cache was quantized before its drafts: BatchDecoder)
    V, raw = vocab_size(model), [d.tokens for d in drafts]
    drafts = in_vocab(drafts, V)
    blocks = [CHAIN if d.parents is None else Tree(cache, d) for d in drafts]
    T = padded_width(rows, drafts, cache)
    ckpt = checkpoint(model, cache, len(rows))
    try:
        inputs = [mx.concatenate([mx.array([r.y], mx.uint32), d.tokens]
                                 + ([mx.full((T - 1 - d.size,), r.y, mx.uint32)] if d.size < T - 1 else []))
                  for r, d in zip(rows, drafts)]
        with overlapped(model) as queued:  # evaluated in pieces while the rest is built
            logits = _forward(model, cache, blocks, inputs, drafts)  # [B, T, V]
        rows_logits, arrays = [], []
        for i, (row, d) in enumerate(zip(rows, drafts)):
            rows_logits.append(processed(row, logits[i, : d.size + 1], inputs[i][: d.size + 1]))
            row.seed_rng(1)
            arrays.append(blocks[i].accept(rows_logits[i], d, row.req.sampling))
        tic = time.perf_counter()
        mx.eval(arrays, raw)  # the one sync
        wait = time.perf_counter() - (queued.at or tic)  # MLX had work from the first piece on
        verdicts, kept, keeps = [], [], []
        for ids in raw:
            refuse_outside(ids.tolist(), V)
        for i, (row, d) in enumerate(zip(rows, drafts)):
            proposed, n, nxt, at = blocks[i].walk([a.tolist() for a in arrays[i]], row.req.sampling)
            kept.append([row.y] + proposed[:n])
            keeps.append(list(range(n + 1)) if isinstance(at, slice) else at)
            at = at if isinstance(at, slice) else mx.array(at)
            # The verify forward's own rows, read before a replay (recurrent targets) records others.
            taps = row.read_taps(i, d.size + 1)
            verdicts.append(Verdict(proposed, n, nxt, taps and {t: h[at] for t, h in taps.items()},
                                    log_softmax(rows_logits[i][at]), d.size, blocks[i].depth))
        if any(b is not CHAIN for b in blocks):  # the kept paths' rows into place
            if single:
                tree.compact(cache, blocks[0].base, keeps[0])
            else:
                tree.compact_rows(cache, T, keeps)
    except BaseException:
        ckpt.restore()
        raise
    if single:
        ckpt.keep(kept[0], T)  # (a tree's path is in place already: nothing left to trim)
        rows[0].last = (ckpt, kept[0])
    else:
        ckpt.keep(kept, T)
        for i, (row, k) in enumerate(zip(rows, kept)):
            row.last = (ckpt.for_row(i, row), k)  # the step, should the row leave mid-block
            if row.last[0] is None:
                row.last = None  # KV and window layers: a row that left trims its own cache
    for row, k in zip(rows, kept):
        row.fed(k)
        row.sync_seconds += wait
    return verdicts
