"""One request inside the decode loop: its drafter, cache, random stream, stop rules and stats.

A `Row` turns each verified block into responses (cutting it at EOS or
`max_tokens`), tells its drafter what the target kept only once the caller
goes on (so that a caller stopping mid-block leaves the drafter exactly at
what it saw), and when it leaves the loop (`settle`) leaves its prompt cache
holding the prompt and every token the caller saw, as mlx-lm's does.
"""

from __future__ import annotations

import logging
import secrets
import time
from dataclasses import dataclass

import mlx.core as mx

from . import prompt_cache
from .cache import CacheRollbackError, Checkpoint, _layers, _snapshot_attrs, make_cache
from .calibration import measuring_seconds
from .drafters.base import EMPTY, Draft
from .request import Request
from .stats import SpecStats
from .taps import Taps

CATCH_UP_MIN = 32  # a smaller backlog is read without weighing it


def _clock() -> float:
    """Seconds for a row's speeds: the time less what this process spent measuring cost curves
    (once per model and machine, inside a step; `calibration.measuring_seconds`), which is no
    request's own work: a first request on a fresh machine reports its real speed."""
    return time.perf_counter() - measuring_seconds()


class ProgressStopped(Exception):
    """A row's prompt progress callback raised `error`: that row stops, the others go on."""

    def __init__(self, error: Exception):
        super().__init__(error)
        self.error = error


@dataclass
class Response:
    """One generated token, with mlx-lm's `GenerationResponse` fields (and `stats` on the last)."""

    text: str  # the new text segment
    token: int
    logprobs: mx.array  # [V] the target's log-probabilities at this position (never the drafter's)
    from_draft: bool
    prompt_tokens: int
    prompt_tps: float
    generation_tokens: int
    generation_tps: float
    peak_memory: float  # GB
    finish_reason: str | None = None  # None, "stop" (EOS) or "length" (max_tokens)
    # The run's statistics so far: one object, updated in place as generation goes on and
    # final on the last response; a caller that stops early (a stop string, a cancelled
    # request) reads the figures of exactly the steps that ran.
    stats: SpecStats | None = None


class Row:
    def __init__(self, uid, model, tokenizer, req: Request, drafter, cache: list, user_cache):
        self.uid, self.model, self.req, self.drafter = uid, model, req, drafter
        self.cache = cache  # this row's own cache whenever it is not merged into a batch
        self.user_cache = user_cache  # the caller's prompt cache (None: dropped at the end)
        self.hist = prompt_cache.history_of(cache) if user_cache is not None else None
        self.start = Checkpoint(model, cache)  # the cache before this request
        self.detok, self.eos = tokenizer.detokenizer, tokenizer.eos_token_ids
        self.stats = SpecStats(prompt_tokens=len(req.prompt))
        self.seed = req.seed if req.seed is not None else secrets.randbits(62)
        self.taps = Taps(model, drafter.taps) if drafter is not None and drafter.taps else None
        self.out: list[int] = []  # tokens handed to the caller (this block's included)
        self.block = 0  # responses in the last block
        self.consumed = 0  # tokens of this request fed into the target's cache
        self.history = mx.zeros((0,), mx.uint32)  # the same tokens, for logits processors
        self.prompt_taps: list = []
        self.y: int | None = None  # the next input: emitted, not yet fed
        self.later = None  # the last step's kept (tokens, taps), told to the drafter later
        self.last = None  # (Checkpoint, kept) of the last single-row step
        self.lengths = None  # draft-length policy, set when the row starts decoding
        self.shape_pick: int | None = None  # auto's tree shape this step (1: the whole tree, 0: a chain)
        self.steps = 0
        self.offer = (0, 0)  # this step's draft: tokens asked of the drafter, tokens it proposed
        self.finish: str | None = None
        self.settled = False  # released: its drafter and prompt cache are free again
        self.claimed: list = []
        self.sync_seconds = 0.0
        self.policy_owner = None  # the drafter `lengths` is the policy of, when not `drafter`
        self.passed = 0  # rows that joined a batch this waiting row could not join, ahead of it
        self.prefill_time = [0, 0.0]  # prompt tokens the target read in chunks, and their seconds
        self.tic = _clock()  # reset when its prompt's reading starts (`start_reading`)
        self.reading = False

    def start_reading(self) -> None:
        """The prompt's reading starts now: its prompt_tps counts from here, not from the time it
        waited behind other rows."""
        if not self.reading:
            self.reading, self.tic = True, _clock()

    # ---- inputs ------------------------------------------------------------------------
    def seed_rng(self, phase: int, step: int | None = None) -> None:
        """Seed MLX's random stream for this row's draws of this step: rows never share one."""
        if self.req.sampling.greedy:  # nothing is drawn
            return
        mx.random.seed(self._rng_seed(phase, step))

    def rng_key(self, phase: int) -> mx.array | None:
        """The key `seed_rng(phase)` would start MLX's global stream from (None: greedy), for
        draws made beside other rows' (`mx.random.split` gives the global stream's sequence)."""
        return None if self.req.sampling.greedy else mx.random.key(self._rng_seed(phase, None))

    def _rng_seed(self, phase: int, step: int | None) -> int:
        step = self.steps if step is None else step
        return (self.seed * 4_000_037 + 4 * step + phase) % (1 << 63)

    def read_taps(self, i: int, keep: int) -> dict | None:
        return None if self.taps is None else {t: h[:keep] for t, h in self.taps.read(i).items()}

    def fed(self, tokens) -> None:
        self.consumed += len(tokens)
        if self.req.logits_processors:
            self.history = mx.concatenate([self.history, mx.array(list(tokens), mx.uint32)])

    def progress(self, done: int, total: int) -> None:
        if self.req.prompt_progress_callback is not None:
            try:
                self.req.prompt_progress_callback(done, total)
            except Exception as e:  # e.g. a server's client left: see `BatchDecoder.step`
                raise ProgressStopped(e) from e

    # ---- steps -------------------------------------------------------------------------
    def prefilled(self, y: int, logprobs: mx.array) -> list[Response]:
        """The prompt is in: the drafter reads it, and the first token is emitted."""
        taps = None
        if self.taps is not None:
            taps = {t: mx.concatenate([c[t] for c in self.prompt_taps]) for t in self.prompt_taps[0]}
        self.prompt_taps = []
        if self.drafter is not None:
            prompt_cache.prefill_drafter(self.drafter, self.hist, self.req.prompt, taps)
        self.stats.prompt_tps = len(self.req.prompt) / (_clock() - self.tic)
        self.tic = _clock()
        return self.emit([(y, False, logprobs)], y)

    def commit_later(self) -> None:
        if self.later is not None:
            self.drafter.commit(*self.later)
            self.later = None

    def verified(self, v, k: int, gain, seconds: float | None) -> list[Response]:
        """A verify step's outcome for this row (k asked, `gain` the policy's estimate)."""
        if self.drafter is not None:
            self.later = ([self.y] + v.proposed[: v.n], v.taps)
        self.lengths.offered(*self.offer)  # before `observe` moves the policy's state
        asked, proposed = self.offer
        self.lengths.observe(v.size if v.depth is None else v.depth, v.n, seconds,  # per depth
                             plain_by_choice=not asked or bool(proposed and not v.size))
        out = self.emit(list(zip(v.emitted, [True] * v.n + [False], v.logprobs)), v.token)
        # the stats count the block the caller got: one cut at a drafted EOS ends there (the drafts
        # past it, kept or not, were never needed; the trace keeps every verified draft)
        shown = sum(r.from_draft for r in out)
        ended = bool(out) and out[-1].from_draft and out[-1].finish_reason is not None
        self.stats.observe(v.proposed, shown, self.req.trace, k, gain, shown if ended else v.size, not ended)
        self.stats.sync_seconds = self.sync_seconds
        self.steps += 1
        return out

    def emit(self, block, y: int) -> list[Response]:
        """Responses for a block, cut at EOS or `max_tokens`; `y` is the row's next input."""
        out, st = [], self.stats
        for token, from_draft, lp in block:
            self.out.append(token)
            n = len(self.out)
            finish = "stop" if token in self.eos else "length" if n == self.req.max_tokens else None
            if token not in self.eos:
                self.detok.add_token(token)
            if finish is not None:
                self.detok.finalize()
            st.generation_tokens = n
            st.generation_tps = n / max(_clock() - self.tic, 1e-9)
            st.peak_memory = mx.get_peak_memory() / 1e9
            out.append(Response(self.detok.last_segment, token, lp, from_draft, len(self.req.prompt),
                                st.prompt_tps, n, st.generation_tps, st.peak_memory, finish, st))
            if finish is not None:
                self.finish = finish
                break
        self.block, self.y = len(out), y
        return out

    def drafting_pays(self, gain: float, step: float | None = None) -> bool:
        """Before its first draft: whether the drafter reading its backlog (the prompt, for a
        draft model: `backlog`) costs less than drafting is expected to save over the tokens
        still to come, at most `max_tokens` of them at the policy's expected `gain` over plain
        decoding. When it does not pay at the first draft it never will (the backlog only
        grows, the tokens left only shrink), so the row then decodes plainly to the end.
        `step`: this row's share of a plain step's seconds (in a batch of B rows, 1/B of the
        batch's step: drafting saves the row that share); default its own plain step.

        A policy that has never seen a draft (nothing learned in this process, nothing kept
        from an earlier one) reads the backlog anyway: its acceptance is then only the cautious
        prior, at which a draft model that pays well in practice can look as if it never
        could, and without one draft nothing would ever be learned. That read is paid once per
        model, drafter kind and sampling mode (what is learned is kept). A policy that has
        learned weighs the read at its hopeful gain (`AdaptiveK.hopeful_gain`: acceptance
        raised by how little of it was seen), not its expected one: after a few requests that
        drafted badly it parks, and weighed at those estimates its probes would never read a
        prompt again, so it would never see that the next workload drafts well. Seeded sampled
        rows, whose policies learn nothing between requests, are weighed at the expected gain.

        Reading costs the draft model's one-token forward (`draft_per_token`) times what a
        prompt token costs the target relative to its one-token forward: measured on this
        row's own prefill (timed policies), else the calibrated 17-token forward's share, an
        upper bound."""
        backlog, costs = getattr(self.drafter, "backlog", 0), self.lengths.costs
        read = getattr(self.drafter, "read", None)  # a mixed drafter: whether its paid members drafted
        drafted = self.stats.drafted if read is None else read
        if (drafted or backlog < CATCH_UP_MIN or not costs.draft_per_token
                or self.req.max_tokens is None  # no limit: any lasting gain repays it
                or self.lengths.timed and not any(map(any, self.lengths.seen))):  # cold: learn
            return True
        if self.lengths.timed:  # what a read teaches is kept: weigh it at what it could show
            gain = max(gain, self.lengths.hopeful_gain())
        share = costs.verify[-1] / len(costs.verify) / costs.verify[0]  # a prompt token / a step
        tokens, seconds = self.prefill_time
        if self.lengths.timed and tokens >= CATCH_UP_MIN:
            share = min(share, seconds / tokens / (costs.verify[0] * (self.lengths.scale or 1.0)))
        left = self.req.max_tokens - len(self.out)
        step = self.lengths.seconds(0) if step is None else step
        return left * step * (1 - 1 / gain) > backlog * costs.draft_per_token * share

    # ---- the end -----------------------------------------------------------------------
    def settle(self, seen: int | None = None) -> None:
        """Leave: the row's own cache holds the prompt and the tokens the caller saw (all of the
        last block unless `seen` says how many of it); the caller's prompt cache gets it."""
        try:
            cut = seen is not None and self.user_cache is not None
            if cut:
                del self.out[len(self.out) - self.block + seen :]
            if not self.out:  # failed before the first token, or none seen: the cache as before the call
                try:
                    self.start.keep([])
                except CacheRollbackError:  # a window that evicted what it held cannot go back:
                    self.cache[:] = make_cache(self.model)  # emptied, never left half-filled
                    if self.user_cache is not None:
                        self.user_cache[:] = self.cache
                        logging.getLogger("mlx_spec").warning(
                            "the prompt cache could not go back to what it held before this request (a "
                            "sliding-window cache read past its window): it was emptied")
            elif self.user_cache is not None:
                self._finish_cache(seen if cut else self.block)
                self.user_cache[:] = self.cache
        finally:
            self.settled = True
            self._keep_learned()
            if self.drafter is not None and hasattr(self.drafter, "forked_from"):
                from .learned import hand_back

                hand_back(self.drafter)
            if self.taps is not None:
                self.taps.remove()
                self.taps = None

    def _keep_learned(self) -> None:
        """What an adaptive policy learned outlives the process (unseeded runs only)."""
        from .adaptive import AdaptiveK
        from .learned import policy_file, save_learned

        keep = getattr(self.drafter, "keep_learned", None)  # a drafter's own (a tree calibration)
        if keep is not None and self.stats.target_forwards:
            keep(self.model)
        if isinstance(self.lengths, AdaptiveK) and self.lengths.timed and self.stats.target_forwards:
            owner = self.policy_owner or self.drafter
            save_learned(self.lengths, policy_file(self.model, owner, self.req.sampling))
            if self.lengths.witness:
                from .calibration import suspect

                suspect(self.model, self.lengths.witness)

    def _finish_cache(self, seen: int) -> None:
        want = len(self.req.prompt) + len(self.out)
        taps = None
        if self.consumed > want:  # the caller stopped inside a kept block
            drop = self.consumed - want
            if self.last is not None:
                ckpt, kept = self.last
                ckpt.keep(kept[: len(kept) - drop])
            else:  # a row that left a batch: plain KV layers
                for c in _layers(self.cache):
                    assert _snapshot_attrs(c) is None
                    c.trim(drop)
        elif self.consumed == want - 1:  # the last token was emitted, not yet fed
            self.model(mx.array([[self.out[-1]]], mx.uint32), cache=self.cache)
            taps = self.read_taps(0, 1)
        mx.eval([c.state for c in self.cache], taps)
        self.consumed = want
        held = None if self.hist is None else self.hist.tokens + self.req.prompt + tuple(self.out)
        prompt_cache.settle(self.cache, held, self.drafter, self.later, seen, self.out[-1], taps)


def propose(rows: list[Row], ks: list[int]) -> list[Draft]:
    """Each row's draft of k tokens (k = 0: none). Rows whose drafters can propose together
    (the same `together()` key: forks of one draft model) do so, one forward per depth."""
    if not any(ks):
        return [EMPTY] * len(rows)
    groups: dict = {}
    for i, (row, k) in enumerate(zip(rows, ks)):
        key = k > 0 and len(rows) > 1 and getattr(row.drafter, "together", None)
        groups.setdefault((key and key()) or ("alone", i), []).append(i)
    drafts = [EMPTY] * len(rows)
    for key, members in groups.items():
        group = [rows[i] for i in members]
        if len(members) > 1:
            made = type(group[0].drafter).propose_together(
                [r.drafter for r in group], [r.y for r in group], [ks[i] for i in members],
                [r.req.sampling for r in group], [r.rng_key(2) for r in group])
        elif ks[members[0]] > 0:
            group[0].seed_rng(2)
            made = [group[0].drafter.propose(group[0].y, ks[members[0]], group[0].req.sampling)]
        else:
            continue
        for i, d in zip(members, made):
            drafts[i] = d
    return drafts
