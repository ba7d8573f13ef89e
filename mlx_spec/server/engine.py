"""The engine: one thread owns all MLX work and serves queued requests one at a time.

HTTP handlers (on the event loop) check a request, build a `Job` and `submit`
it; the job waits in a bounded FIFO queue (full: `QueueFull`, a 429) until the
engine thread takes it. The engine fetches the longest cached prefix of the
prompt from its `PromptCacheStore`, iterates `mlx_spec.stream_generate` over the
rest, cuts stop strings exactly (`text.StopCutter`), and sends one `Piece` per
token, then `Finished` (or `Failed`), back to the event loop. A cancelled job
(its client went away) leaves the queue at once, or, running, stops after the
token being handled: the generator only runs the next decode step when asked,
so that is within one step. Closing the generator leaves the cache holding the
prompt and the tokens handed out, and it goes back to the store.

Each turn of the engine loop (`_round`) first applies a `Plan` (rows that end,
with how many tokens of their last block the client saw; jobs that join; closing),
then runs one decode step. On a target sharded over several ranks the same loop
runs on every rank: rank 0 makes the plan and sends it before each step
(`link.Link`), the others apply what they receive, so every rank runs the same
forwards in the same order; rank 0 alone turns tokens into text and answers.

Per-request figures (`Usage`) are added to the server's counters (`Metrics`)
before the client hears that its request finished, so `/metrics` totals always
equal the sums of what clients were told.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections import deque
from dataclasses import dataclass

from ..handover import explain, materialize
from .events import Failed, Finished, Job, Piece, Usage, drafter_kind, logprob  # noqa: F401
from .link import Plan
from .metrics import Metrics
from .params import with_history
from .text import StopCutter

log = logging.getLogger("mlx_spec.server")

class QueueFull(Exception):
    pass


class Closing(Exception):
    """The server is shutting down: no new job is taken."""

    def __str__(self) -> str:
        return "the server is shutting down; retry on another server or once it has restarted"


class _Cancelled(Exception):
    """Raised from the prefill's progress callback when the client has left."""


@dataclass
class Run:
    """A job the decoder is working on."""

    job: Job
    cache: list
    cached: int  # prompt tokens served from the prompt cache
    drafter: object  # this job's fork of the server's drafter, or None
    cut: StopCutter
    n: int = 0  # tokens handed out
    last: object = None  # the last Response


class Engine:
    """Serves jobs on its own thread, up to `max_batch` decoding together, with a prompt
    cache across requests."""

    def __init__(self, model, tokenizer, drafter=None, *, model_id: str = "model",
                 num_draft_tokens="auto", max_queue: int = 16, prompt_cache_bytes: int = 1 << 30,
                 max_batch: int = 4, link=None, on_fatal=None, cache_options: dict | None = None):
        from mlx_lm.tokenizer_utils import TokenizerWrapper

        from ..drafters.base import vocab_size
        from ..prompt_cache import PromptCacheStore
        from ..request import make_request
        from .params import context_length
        from .text import make_machine

        if not isinstance(tokenizer, TokenizerWrapper):
            tokenizer = TokenizerWrapper(tokenizer)
        self.model, self.tokenizer, self.drafter = model, tokenizer, drafter
        self.model_id, self.drafter_kind = model_id, drafter_kind(drafter)
        self.num_draft_tokens, self.max_queue = num_draft_tokens, max_queue
        # A drafter that cannot fork serves one request at a time.
        self.max_batch = max_batch if drafter is None or hasattr(drafter, "fork") else 1
        self.vocab_size, self.context_length = vocab_size(model), context_length(model)
        self.machine = make_machine(tokenizer)
        # mlx-lm's KV cache options for every request (max_kv_size, kv_bits, ...): checked now
        self.cache_options = {k: v for k, v in (cache_options or {}).items() if v is not None}
        make_request(model, tokenizer, [0], **self.cache_options)
        self.store = PromptCacheStore(model, prompt_cache_bytes, self.cache_options.get("max_kv_size"))
        self.metrics = Metrics()
        self.created = int(time.time())
        self._waiting: deque[Job] = deque()
        self._runs: dict[int, Run] = {}  # decoder uid -> run (engine thread only)
        self._cond = threading.Condition()
        self._closing = False
        self._ending: list[tuple] = []  # (uid, reason, error, seen): rows to end before the next step
        # A sharded target: rank 0 serves HTTP and sends each step's plan; the others mirror it.
        self.link, self.leader = link, link is None or link.leader
        self.on_fatal, self.fatal = on_fatal, None  # what stopped the loop, if anything did
        self._thread = threading.Thread(target=self._loop, name="mlx-spec-engine", daemon=True)

    # ---- the event loop's side --------------------------------------------------------------

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @property
    def running(self) -> int:
        return len(self._runs)

    def submit(self, job: Job) -> None:
        with self._cond:
            if self._closing:
                raise Closing()
            free = max(0, self.max_batch - len(self._runs))  # jobs that join at the next step
            if len(self._waiting) - free >= self.max_queue:
                raise QueueFull(f"all {self.max_batch} places are taken (--max-batch) and " + (
                    "--max-queue 0 lets no request wait" if self.max_queue == 0 else
                    f"{len(self._waiting) - free} requests already wait (--max-queue {self.max_queue})")
                    + "; retry later")
            self._waiting.append(job)
            self._cond.notify()

    def cancel(self, job: Job) -> None:
        """Stop `job`: out of the queue now, or after the token being handled if running."""
        job.cancelled.set()
        with self._cond:
            try:
                self._waiting.remove(job)
            except ValueError:
                return  # running (it stops itself) or already done
        self.metrics.request_done("cancelled")
        job.done = True
        job.send(Finished("cancelled", Usage(len(job.prompt), 0, 0, 0.0, 0.0, None,
                                             job.options.get("num_draft_tokens", "auto"))))

    def start(self, warm_up: bool = True) -> Engine:
        """Start the engine thread; `warm_up` runs a first tiny generation (and the verify cost
        calibration `num_draft_tokens="auto"` needs) there before returning, so the first
        client does not pay for it."""
        materialize(self.model, self.drafter)  # MLX streams belong to a thread
        self._warm = threading.Event()
        self._warm_up_first = warm_up
        self._thread.start()
        if not self._warm.wait(600):
            raise RuntimeError("the engine did not finish its warm-up in 10 minutes")
        if self._warm_error is not None:
            raise self._warm_error
        return self

    def close(self, timeout: float = 30.0) -> None:
        """Cancel every job and stop the engine thread."""
        with self._cond:
            self._closing = True
            jobs = list(self._waiting) + [r.job for r in list(self._runs.values()) if r.job]
            self._cond.notify_all()
        for job in jobs:
            self.cancel(job)
        if self._thread.is_alive():
            self._thread.join(timeout)

    def wait(self) -> BaseException | None:
        """On a rank other than 0: mirror rank 0 until it closes; what stopped it, if anything."""
        self._thread.join()
        return self.fatal

    # ---- the engine thread ------------------------------------------------------------------

    def _warm_up(self) -> None:
        from .. import decode
        from ..calibration import verify_seconds

        decode.generate(self.model, self.tokenizer, [self.vocab_size // 2] * 4, None, max_tokens=2)
        if self.drafter is not None and self.num_draft_tokens == "auto":
            verify_seconds(self.model)
            if getattr(self.drafter, "model", None) is not None:
                verify_seconds(self.drafter.model, n_max=1)
        if self.link is not None and self.drafter is not None and self.max_batch > 1:
            # The batch policy reads this curve when its timings say so, which differs between
            # ranks; every forward must run on every rank, so all ranks measure it now.
            from ..batch_policy import wide_verify_seconds

            verify_seconds(self.model)
            wide_verify_seconds(self.model)

    def _loop(self) -> None:
        self._warm_error = None
        try:
            if self._warm_up_first:
                self._warm_up()
        except Exception as e:  # reported by start(), on the caller's thread
            self._warm_error = explain(e)
            return
        finally:
            self._warm.set()
        import mlx.core as mx
        from mlx_lm.generate import generation_stream

        from ..batch import BatchDecoder

        self.decoder = BatchDecoder(self.model, self.tokenizer, max_batch=self.max_batch)
        try:
            # Every array this thread makes goes to the decoder's stream. (Arrays made here
            # outside it, a logit_bias a sharded rank rebuilt, ended the process with
            # "terminate called without an active exception" at exit, MLX 0.32.4, CPU.)
            with mx.stream(generation_stream):
                while self._round():
                    pass
        except BaseException as e:  # a sharded rank out of step, a lost peer, or a bug
            self._die(e)

    def _round(self) -> bool:
        """One turn, the same on every rank: rank 0's plan, applied, then one decode step.
        False once the server closes."""
        plan = self._plan() if self.leader else Plan()
        if self.link is not None:
            wire = self.link.exchange(plan.wire() if self.leader else None)
            if not self.leader:
                plan = Plan.from_wire(wire)
        for end in plan.ends:
            self._end(*end)
        for admit in plan.admits:
            self._admit(*admit)
        if plan.closing:
            for uid in list(self._runs):
                self._end(uid, "cancelled")
            return False
        if self.decoder.busy:
            self._step()
        return True

    def _plan(self) -> Plan:
        """Rank 0's decisions for the next step: rows that end, jobs that join, closing."""
        from .link import HEARTBEAT, admit_message

        with self._cond:
            while not (self._waiting or self._runs or self._closing or self._ending):
                if not self._cond.wait(HEARTBEAT if self.link is not None else None):
                    break  # an empty plan: the other ranks hear that rank 0 is alive
            plan = Plan(self._ending, [], self._closing)
            self._ending = []
            ending = {e[0] for e in plan.ends}
            plan.ends += [(uid, "cancelled", None, None) for uid, run in self._runs.items()
                          if uid not in ending and run.job.cancelled.is_set() and run.n == 0]
            room = self.max_batch - len(self._runs) + len(plan.ends)
            while self._waiting and len(plan.admits) < room and not plan.closing:
                job = self._waiting.popleft()
                admit = (job, job.prompt, job.options, job.use_drafter, secrets.randbits(62))
                if self.link is not None:
                    try:
                        plan.messages.append(admit_message(job, admit[-1]))
                    except ValueError as e:
                        self._refuse(job, e)
                        continue
                plan.admits.append(admit)
        return plan

    def _admit(self, job: Job | None, prompt: list, options: dict, use_drafter: bool, seed: int) -> None:
        """A job becomes a row of the decoder (prompt cache fetched, drafter forked). `job` is
        None on the other ranks of a sharded server, which only mirror rank 0."""
        sharded = self.link is not None
        cache, cached = self.link.agree_fetch(self.store, prompt) if sharded else self.store.fetch(prompt)
        if job is not None:  # before the job's first event, which carries it to the handler
            job.cached = cached
        drafter = None
        if use_drafter and self.drafter is not None:  # its own state, the server drafter's weights
            drafter = self.drafter.fork() if hasattr(self.drafter, "fork") else self.drafter

        def progress(done: int, total: int) -> None:  # between prefill chunks
            if job.cancelled.is_set():
                raise _Cancelled(job)

        if cached and options.get("logits_processors"):  # penalties read the cached prompt too
            options = {**options, "logits_processors": with_history(options["logits_processors"], prompt[:cached])}
        # Sharded, a prefill is never cut short (the other ranks would go on): the row ends
        # after the step instead.
        try:
            uid = self.decoder.add(prompt[cached:], drafter, prompt_cache=cache, rng_seed=seed,
                                   prompt_progress_callback=None if sharded else progress,
                                   **self.cache_options, **options)
        except BaseException as e:  # bad options: the same on every rank
            self.store.put(cache)
            if job is not None:
                self._refuse(job, e)
            return
        self._runs[uid] = Run(job, cache, cached, drafter, StopCutter(job.stops if job else ()))

    def _refuse(self, job: Job, error: BaseException) -> None:
        self.metrics.request_done("failed")
        job.done = True
        job.send(Failed(error))

    def _step(self) -> None:
        try:
            events = self.decoder.step()
        except _Cancelled as c:  # a client left during its prefill: its cache is as before
            uid = next(u for u, r in self._runs.items() if r.job is c.args[0])
            self._ending.append((uid, "cancelled", None, None))
            return
        except BaseException as e:
            if self.link is not None:  # the ranks may disagree from here on: every rank stops
                raise
            log.exception("a decode step failed")  # never let one request end the engine
            self._ending += [(uid, "failed", explain(e), None) for uid in self._runs]
            return
        if not self.leader:  # rank 0 decides what the tokens mean; it sends the endings
            return
        if self.decoder.width:
            self.metrics.batch_step(self.decoder.width)
        # A row that starts while others decode has two blocks in one step (its first token, then
        # its verified block): it ends once, at the first block that ends it; `seen` counts the
        # tokens of its last block the client got (none, when it ended in an earlier one).
        last, ended = {uid: i for i, (uid, _) in enumerate(events)}, set()
        for i, (uid, block) in enumerate(events):
            if uid in ended:
                continue
            run = self._runs[uid]
            for seen, r in enumerate(block, 1):
                run.n, run.last = run.n + 1, r
                text = run.cut.feed(r.text)
                reason = "stop" if run.cut.matched is not None else r.finish_reason
                if r.finish_reason is not None and run.cut.matched is None:
                    text += run.cut.flush()
                run.job.send(Piece(text, r.token, logprob(self.tokenizer, r, run.job.logprobs)))
                if reason is None and run.job.cancelled.is_set():
                    reason = "cancelled"
                if reason is not None:
                    self._ending.append((uid, reason, None, seen if last[uid] == i else 0))
                    ended.add(uid)
                    break

    def _end(self, uid: int, reason: str | None, error: BaseException | None = None,
             seen: int | None = None) -> None:
        """Release the row (its cache holds the prompt and the tokens handed out; it goes back to
        the store), count the request and tell its client."""
        run = self._runs.pop(uid, None)
        if run is None:
            from ..distributed import DesyncError

            raise DesyncError(f"rank {self.link.rank if self.link else 0} has no request {uid} "
                              "to end: out of step with rank 0")
        try:
            self.decoder.release(uid, seen)
        except BaseException as e:
            if run.job is None:
                raise
            error = error or e
        self.store.put(run.cache)
        if run.job is None:  # another rank's mirror of a request
            return
        run.job.done = True
        if error is not None:
            self.metrics.request_done("failed")
            run.job.send(Failed(error))
            return
        job, stats = run.job, run.last.stats if run.last is not None else None
        usage = Usage(len(job.prompt), run.cached, run.n,
                      (len(job.prompt) - run.cached) / stats.prompt_tps if stats and stats.prompt_tps else 0.0,
                      run.n / stats.generation_tps if stats and stats.generation_tps else 0.0,
                      self.drafter_kind if run.drafter is not None else None,
                      job.options.get("num_draft_tokens", "auto"), stats)
        self.metrics.request_done("cancelled" if reason == "cancelled" else "completed",
                                  usage if reason != "cancelled" or run.n else None)
        job.send(Finished(reason, usage, run.cut.matched))

    def _die(self, error: BaseException) -> None:
        """The loop cannot go on: fail every request, and tell the server (`on_fatal`)."""
        error = explain(error)
        who = f"rank {self.link.rank}: " if self.link is not None else ""
        log.error("%sthe engine stopped: %s: %s", who, type(error).__name__, error)
        self.fatal = error
        with self._cond:
            self._closing = True
            jobs = list(self._waiting) + [r.job for r in self._runs.values() if r.job is not None]
            self._waiting.clear()
        for job in jobs:
            job.done = True
            job.send(Failed(error))
        if self.on_fatal is not None:
            self.on_fatal(error)

