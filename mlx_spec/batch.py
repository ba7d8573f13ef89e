"""The decode loop for any number of requests: rows join, prefill, verify together, leave.

    decoder = BatchDecoder(model, tokenizer, max_batch=4)
    a = decoder.add("Hello", NGramDrafter(), max_tokens=64)
    b = decoder.add([1, 2, 3], None, temp=0.7, seed=1)
    while decoder.busy:
        for uid, responses in decoder.step():   # each row's block of this step
            ...
        decoder.release(...)                     # rows the caller is done with

Each step: at most one prefill chunk of a newly added row (a long prompt never
stalls the others for long; short prompts of rows at the front of the queue are read
together, within one chunk), then one verify forward over every decoding row,
each with its own draft (its own drafter, length, sampling and seed), and each
row keeps exactly its own accepted prefix (`mlx_spec.batch_cache`). A single
row is the batch of one: its own cache, any cache kind. Plain and quantized KV,
sliding-window (with sink positions too) and recurrent layers merge into a batch of
rows whose caches are of one kind (`batch_cache.kind`; a `kv_bits` row once its cache
is quantized, or when it cannot get long enough to be); a row of another kind waits
for the batch in front of it, and caches that cannot be merged (DeepSeek-V4.1's layer
cache) decode one at a time. `stream_generate` is this loop with one row.
"""

from __future__ import annotations

import itertools
import logging
import time

import mlx.core as mx
from mlx_lm.generate import generation_stream

from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.tokenizer_utils import TokenizerWrapper

from . import batch_cache, batch_plain, batch_quantized, tree, tree_shape, verify
from .adaptive import AdaptiveK
from .calibration import one_time_seconds
from .agreed import agree_seed
from .cache import is_recurrent, prepare_cache
from .drafters.base import EMPTY, Draft
from .row_lengths import choose_lengths, draft_lengths
from .identity import Claims
from .overlap import step_clock
from .request import make_request, refuse_unsupported, resolve_drafter, whole
from .rows import ProgressStopped, Response, Row, propose

log = logging.getLogger("mlx_spec")
PREFILL_CHUNK = 512  # prompt tokens fed per step while other rows decode
CLAIMS = Claims()  # drafters and prompt caches in use by a live request
OPTIONS = {"max_tokens", "num_draft_tokens", "temp", "top_p", "top_k", "min_p", "seed",
           "logits_processors", "prompt_progress_callback", "prefill_step_size", "max_kv_size",
           "kv_bits", "kv_group_size", "quantized_kv_start", "trace"}


class BatchDecoder:
    def __init__(self, model, tokenizer, max_batch: int = 8, prefill_chunk: int = PREFILL_CHUNK):
        if not (whole(max_batch) and max_batch >= 1):
            raise ValueError(f"max_batch must be an integer >= 1, got {max_batch!r}")
        if not isinstance(tokenizer, TokenizerWrapper):
            tokenizer = TokenizerWrapper(tokenizer)
        self.model, self.tokenizer = model, tokenizer
        self.max_batch, self.prefill_chunk = max_batch, prefill_chunk
        self.waiting: list[Row] = []  # added, prompt not (fully) in yet; in order (`_next_waiting`)
        self.active: list[Row] = []  # decoding; merged into `self.batch` when more than one
        self.done: dict = {}  # finished rows the caller has not released yet
        self.batch: list | None = None
        self.kind = None  # the cache kind of the batch's rows (`batch_cache.kind`)
        self.flight = None  # a batched plain step in flight (batch_plain), built ahead
        self._uids = itertools.count()
        self._said_solo = False
        self._carried: list = []  # events of a step that raised a row's callback error (`step`)
        self._stopped: list[Exception] = []  # those errors, this step

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.active or self._carried)

    def add(self, prompt, drafter=None, *, draft_model=None, prompt_cache: list | None = None,
            rng_seed: int | None = None, **options) -> int:
        """Queue a request; returns its uid. Arguments as `stream_generate`'s, checked here
        (bad input raises before any model work). `drafter` is used by this request alone
        until it is released (`mlx_spec.InUseError` otherwise). `rng_seed`: the random
        stream of a request without `seed` (drawn at random otherwise), for callers that
        must draw the same tokens elsewhere (the ranks of a sharded server)."""
        refuse_unsupported({k: v for k, v in options.items() if k not in OPTIONS})
        req = make_request(self.model, self.tokenizer, prompt, **options)
        drafter = resolve_drafter(drafter, draft_model, CLAIMS)
        claimed = [(o, what) for o, what in ((drafter, "drafter"), (prompt_cache, "prompt cache"))
                   if o is not None]
        for obj, what in claimed:
            CLAIMS.check(obj, what)
        if prompt_cache is None:
            cache = prepare_cache(self.model, make_prompt_cache(self.model, req.max_kv_size))
        else:
            cache = prepare_cache(self.model, prompt_cache)
        if drafter is not None:
            drafter.bind(self.model, self.tokenizer)  # checks the pair and resets it
        uid = next(self._uids)
        row = Row(uid, self.model, self.tokenizer, req, drafter, cache, prompt_cache)
        if req.seed is None and rng_seed is None and not req.sampling.greedy:
            rng_seed = agree_seed(self.model)  # a sharded target: rank 0's, on every rank
        if req.seed is None and rng_seed is not None:
            row.seed = rng_seed
        row.claimed = [obj for obj, _ in claimed]
        for obj in row.claimed:
            CLAIMS.take(obj, row)
        self.waiting.append(row)
        return uid

    def hand_over(self, uid: int, owner) -> None:
        """Row `uid`'s drafter and prompt cache are in use while `owner` (a generator) lives."""
        row = next(r for r in self.waiting if r.uid == uid)
        for obj in row.claimed:
            CLAIMS.take(obj, owner)

    # ---- one step ----------------------------------------------------------------------
    def step(self) -> list[tuple[int, list[Response]]]:
        """Advance every row by one step; returns each row's new responses.

        With rows already decoding, one prefill chunk of the next waiting row goes first (or
        the short prompts of the rows at the front of the queue, read together);
        with none, every waiting row that fits is prefilled whole, so they start together,
        and the step ends there: their first tokens go out at once (the time to first token
        is the prefill's), and their first drafts are verified in the next step.

        A row whose prompt progress callback raises (a server's client that left) stops alone:
        it goes to `done` unfinished, the step goes on for the others, and then raises that
        error; the events it made come first from the next call.
        """
        events, decoding = self._carried, bool(self.active)
        self._carried, self._stopped = [], []
        self.width = 0  # rows verified together in this step
        with mx.stream(generation_stream):
            grouped = self._start_together(events, decoding)
            while not (decoding and grouped) and (row := self._next_waiting()) is not None:
                row.start_reading()
                try:
                    first = verify.prefill(self.model, row, self.prefill_chunk if decoding else None)
                    if first is not None:
                        first = row.prefilled(*first)
                except ProgressStopped as stop:
                    self._stop(row, stop)
                    if decoding:
                        break
                    continue
                except BaseException:
                    self._drop_waiting([row])
                    raise
                if first is None:
                    break
                i = self.waiting.index(row)
                for earlier in self.waiting[:i]:  # rows it passed
                    earlier.passed += 1
                self._started(row, first, events)
                if decoding:
                    break
            if self.active and decoding:
                events += self._verify()
        if self._stopped:
            self._carried = events
            raise self._stopped[0]
        return events

    def _start_together(self, events: list, decoding: bool) -> bool:
        """The waiting rows at the front that can share one batch and are `verify.fresh` are
        prefilled together (`verify.prefill_together`), then start. While rows decode: as many
        as the batch has room for, of its cache kind, and only while their prompts together
        fit one prefill chunk (what the decoding rows wait for stays a chunk's read)."""
        if not self.waiting:
            return False
        group, tokens = [], 0
        kind = self._kind(self.active[0]) if decoding else None
        for row in self.waiting[: self.max_batch - len(self.active)]:
            mine = self._kind(row) if verify.fresh(row) else None
            tokens += len(row.req.prompt)
            if mine is None or (group or decoding) and mine != kind or decoding and tokens > self.prefill_chunk:
                break
            group.append(row)
            kind = mine
        if len(group) < 2:
            return False
        group = [row for row in group if self._told(row, 0)]
        if not group:
            return False
        for row in group:
            row.start_reading()
        try:
            firsts = [row.prefilled(*first) for row, first in zip(group, verify.prefill_together(self.model, group))]
        except BaseException:
            self._drop_waiting(group)
            raise
        for row, first in zip(group, firsts):
            if self._told(row, len(row.req.prompt)):
                self._started(row, first, events)
        return True

    def _told(self, row: Row, done: int) -> bool:
        """Call `row`'s progress callback; False if it raised (the row then stops: `step`)."""
        try:
            row.progress(done, len(row.req.prompt))
            return True
        except ProgressStopped as stop:
            self._stop(row, stop)
            return False

    def _stop(self, row: Row, stop: ProgressStopped) -> None:
        self._drop_waiting([row])
        self._stopped.append(stop.error)

    def _drop_waiting(self, rows: list[Row]) -> None:
        for row in rows:
            self.waiting.remove(row)
            self.done[row.uid] = row

    def _started(self, row: Row, first: list[Response], events: list) -> None:
        """`row`'s prompt is in and its first token emitted: it joins the batch (or is done)."""
        self.waiting.remove(row)
        events.append((row.uid, first))
        self._start(row) if row.finish is None else self._finish(row)

    def _next_waiting(self) -> Row | None:
        """The waiting row to prefill next: the first that can join the batch. A row that
        cannot (another cache kind) is passed by the rows behind it that can, by at most
        `max_batch` of them; then nothing passes it, the batch drains and it starts."""
        for row in self.waiting:
            if self._room_for(row):
                return row
            if len(self.active) >= self.max_batch or row.passed >= self.max_batch:
                return None
        return None

    def _room_for(self, row: Row) -> bool:
        if not self.active:
            return True
        mine = self._kind(row)
        solo = mine is None or mine != self._kind(self.active[0])
        if solo and not self._said_solo:
            self._said_solo = True
            log.info("these requests cannot decode in one batch (a cache that is not KV, window "
                     "or recurrent, will be quantized later, or differs from the batch's: kv_bits, "
                     "max_kv_size); a request waits for the batch in front of it, passed by "
                     "requests that can join it")
        return not solo and len(self.active) < self.max_batch

    def _kind(self, row: Row):
        """The kind of cache `row` would bring into a batch (None: it cannot join one)."""
        if row.cache is None:  # merged: the batch's
            return self.kind
        ahead = max(0, len(row.req.prompt) - row.consumed)  # a waiting row's prompt still to go in
        return batch_cache.kind(row.cache, row.req, ahead, len(row.out))

    def _land(self) -> None:
        """Take back a batched plain step in flight: the batch is about to change."""
        batch_plain.land(self.flight, self.active)
        self.flight = None

    def _start(self, row: Row) -> None:
        row.lengths = draft_lengths(self.model, row, is_recurrent(row.cache))
        self._land()
        if self.active:
            for r in (row, self.active[0]) if self.batch is None else (row,):
                r.req.quantize_cache(r.cache)  # what its next step alone would do first
            if self.batch is None:
                self.kind = self._kind(row)
                self.batch = batch_cache.merge([self.active[0].cache, row.cache])
                self.active[0].cache = None
            else:
                batch_cache.join(self.batch, row.cache)
            row.cache = None
        self.active.append(row)

    def _verify(self) -> list[tuple[int, list[Response]]]:
        rows = self.active
        self.width = len(rows)
        t0, once = time.perf_counter(), one_time_seconds()
        for row in rows:  # the caller went on: the drafters learn what it saw (a policy may look)
            row.commit_later()
        choices = choose_lengths(self.model, rows)
        if self.flight is not None and any(k for k, _ in choices):
            self._land()  # a probe after all: the plain step queued for this one is taken back
        try:
            with step_clock():  # the drafters' forwards and the verify: one busy span for MLX
                drafts, verdicts, timed = self._draft_and_verify(rows, choices)
        except BaseException:
            for row in list(rows):  # a failed step ends every row in it
                self._finish(row)
            raise
        seconds = time.perf_counter() - t0 - (one_time_seconds() - once)  # (a calibration, a backlog read)
        learn = seconds if timed else None  # what the policies learn from (`batch_plain.step`)
        if learn is not None and len(rows) > 1 and not any(r.req.repeatable for r in rows):  # seeded: no timings
            from .batch_policy import observe_batch

            observe_batch(self.model, [r.lengths for r in rows], [d.size for d in drafts], seconds)
        events = []
        for row, v, (k, gain) in zip(list(rows), verdicts, choices):
            row.stats.tree_steps += v.depth is not None  # verified as a tree
            if row.shape_pick is not None:  # a lone timed row: what the step took, its drafting
                p = row.lengths  # included; else its prediction, in the same units (`scale`)
                alone = learn is not None and len(rows) == 1 and p.timed
                p.shapes.observe(row.shape_pick, v.n + 1, learn if alone else p.seconds(v.size) * (p.scale or 1.0))
                row.shape_pick = None
            events.append((row.uid, row.verified(v, k, gain, learn if len(rows) == 1 else None)))
            row.stats.step_seconds += seconds
            row.stats.batch_sizes.append(len(verdicts))
            if row.finish is not None:
                self._finish(row)
        return events

    def _draft_and_verify(self, rows: list[Row], choices) -> tuple[list, list]:
        ks = []
        for row, (k, _) in zip(rows, choices):
            if row.req.max_tokens is not None:
                k = min(k, row.req.max_tokens - len(row.out) - 1)  # the block's end must fit
            if row.req.kv_bits is not None and self.batch is None:
                k = min(k, batch_quantized.unquantized_room(row))
            ks.append(k)
        cache = self.batch if self.batch is not None else rows[0].cache
        if self.batch is None:  # mlx-lm's kv_bits quantization first: a quantized cache verifies chains
            rows[0].req.quantize_cache(cache)  # (rows in a batch are settled: batch_cache.kind)
        for row, k in zip(rows, ks):  # auto's tree shape, before drafting when the drafter can take it
            if k and getattr(row.drafter, "plans_trees", bool)():
                if not tree_shape.verifies_trees(self.model, row, cache, len(rows)):
                    row.drafter.plan_tree(0)  # a chain: only one branch of a tree would be verified
                elif isinstance(row.lengths, AdaptiveK):
                    row.drafter.plan_tree(tree_shape.pick(self.model, row))
        drafts = propose(rows, ks)
        for row, k, d in zip(rows, ks, drafts):
            row.offer = (k, d.size)  # asked, proposed (before any trimming)
        drafts = [tree_shape.shaped(self.model, d, row, cache, len(rows)) for d, row in zip(drafts, rows)]
        if len(rows) > 1 and any(d.size for d in drafts):
            drafts = _trimmed(self.model, rows, drafts)
        if all(d.size == 0 for d in drafts) and all(map(batch_plain.eligible, rows)):
            ahead = all(k == 0 for k, _ in choices) and batch_plain.plain_next_step(self.model, rows)
            verdicts, self.flight, timed = batch_plain.step(self.model, cache, rows, self.flight, ahead)
            return drafts, verdicts, timed
        self._land()
        return drafts, verify.verify(self.model, cache, rows, drafts), True

    # ---- leaving -----------------------------------------------------------------------
    def _finish(self, row: Row) -> None:
        """Take a row out of the batch (its cache back as its own); it waits for `release`."""
        if row in self.active:
            self._land()
            i = self.active.index(row)
            if self.batch is not None:
                row.cache = batch_cache.extract(self.batch, i)
                batch_cache.remove(self.batch, i, len(self.active))
            self.active.pop(i)
            if len(self.active) == 1 and self.batch is not None:
                self.active[0].cache = batch_cache.extract(self.batch, 0)
                self.batch = None
        self.done[row.uid] = row

    def release(self, uid: int, seen: int | None = None) -> None:
        """The caller is done with row `uid` (finished or not), having seen `seen` responses of
        its last block in `step()`'s result (None: all; a row that started while others decode
        has two blocks in one step, its first token and then its verified block): its prompt
        cache is left as the caller saw it."""
        self._carried = [e for e in self._carried if e[0] != uid]
        row = next((r for r in self.waiting if r.uid == uid), None)
        if row is not None:
            self.waiting.remove(row)
            self.done[uid] = row
        row = next((r for r in self.active if r.uid == uid), None)
        if row is not None:
            self._finish(row)
        row = self.done.pop(uid, None)
        if row is not None:
            with mx.stream(generation_stream):
                row.settle(seen)


def _trimmed(model, rows: list[Row], drafts: list) -> list:
    """The batch's drafts cut to what pays verifying (`batch_policy.trim_drafts`); on a
    sharded target every rank takes rank 0's lengths."""
    from .batch_policy import trim_drafts
    from .agreed import agree_lengths

    keep = trim_drafts(model, [r.lengths for r in rows], drafts, [r.offer[0] for r in rows])
    keep = [n for n, _ in agree_lengths(model, [(n, None) for n in keep])]
    return [d if n >= d.size else EMPTY if n == 0 else tree.first_nodes(d, n) if d.parents is not None else
            Draft(d.tokens[:n], None if d.q is None else d.q[:n], None if d.length is None else mx.minimum(d.length, n))
            for d, n in zip(drafts, keep)]
