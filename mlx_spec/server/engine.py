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

Per-request figures (`Usage`) are added to the server's counters (`Metrics`)
before the client hears that its request finished, so `/metrics` totals always
equal the sums of what clients were told.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass, field

from .metrics import Metrics
from .text import StopCutter

log = logging.getLogger("mlx_spec.server")

# Drafter classes -> the kind a request names in `draft`
KINDS = {"NGramDrafter": "ngram", "DraftModelDrafter": "draft-model", "EagleDrafter": "eagle",
         "MTPDrafter": "mtp", "DFlashDrafter": "dflash", "DSparkDrafter": "dspark",
         "V4DSparkDrafter": "dspark"}


def drafter_kind(drafter) -> str | None:
    if drafter is None:
        return None
    name = type(drafter).__name__
    return KINDS.get(name, name.removesuffix("Drafter").lower())


class QueueFull(Exception):
    pass


class _Cancelled(Exception):
    """Raised from the prefill's progress callback when the client has left."""


@dataclass
class Piece:
    """One generated token: the text it releases (after stop strings) and its log-probs."""

    text: str
    token: int
    logprob: tuple | None = None  # (token text, log-prob, [(text, log-prob), ...] top n)


@dataclass
class Usage:
    """What one request cost: tokens, times, and the speculation statistics."""

    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    prompt_seconds: float
    decode_seconds: float
    drafter: str | None  # the kind that ran, None for plain decoding
    num_draft_tokens: int | str
    stats: object = None  # mlx_spec.SpecStats

    def usage(self) -> dict:
        """OpenAI's `usage`."""
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}

    def timings(self) -> dict:
        """llama.cpp server's `timings`; `draft_n` and `draft_n_accepted` when a drafter ran."""
        prompt_n = self.prompt_tokens - self.cached_tokens
        out = {"cache_n": self.cached_tokens, "prompt_n": prompt_n}
        out.update(_rate("prompt", prompt_n, self.prompt_seconds))
        out["predicted_n"] = self.completion_tokens
        out.update(_rate("predicted", self.completion_tokens, self.decode_seconds))
        if self.drafter is not None and self.stats is not None:
            out["draft_n"] = self.stats.drafted
            out["draft_n_accepted"] = self.stats.accepted
        return out

    def speculative(self) -> dict:
        """mlx-spec's own per-request statistics."""
        s = self.stats
        return {
            "drafter": self.drafter or "none",
            "num_draft_tokens": self.num_draft_tokens if self.drafter else None,
            "target_forwards": s.target_forwards if s else 0,
            "drafts": s.drafts if s else 0,
            "drafted": s.drafted if s else 0,
            "accepted": s.accepted if s else 0,
            "tau": round(s.tau, 4) if s else 0.0,
            "acceptance_rate": round(s.acceptance_rate, 4) if s else 0.0,
            "accepted_per_position": [round(a, 4) for a in s.accepted_per_position] if s else [],
            "accepted_at_position": s.accepted_at_position if s else [],
            "chosen_k": list(s.chosen_k) if s else [],
        }


def _rate(name: str, n: int, seconds: float) -> dict:
    ms = 1000 * seconds
    return {f"{name}_ms": round(ms, 3), f"{name}_per_token_ms": round(ms / n, 3) if n else 0.0,
            f"{name}_per_second": round(n / seconds, 3) if seconds > 0 else 0.0}


@dataclass
class Finished:
    reason: str  # "stop" (EOS or a stop string), "length", or "cancelled"
    usage: Usage
    stop_sequence: str | None = None  # the stop string that ended the text


@dataclass
class Failed:
    error: BaseException


@dataclass(eq=False)
class Job:
    """One request for the engine, and the channel its results come back on."""

    prompt: list[int]
    options: dict  # stream_generate keywords
    use_drafter: bool = True
    stops: tuple[str, ...] = ()
    logprobs: int | None = None  # None: no log-probs; n: the chosen token's and the top n
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:24])
    cancelled: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self):
        self.loop = asyncio.get_running_loop()
        self.events: asyncio.Queue = asyncio.Queue()
        self.done = False  # the engine sent its last event

    def send(self, event) -> None:
        """From the engine thread: hand `event` to the waiting handler."""
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the event loop is gone (server shutting down)
            self.cancelled.set()

    async def next(self):
        return await self.events.get()


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
                 max_batch: int = 4):
        from mlx_lm.tokenizer_utils import TokenizerWrapper

        from ..drafters.base import vocab_size
        from ..prompt_cache import PromptCacheStore
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
        self.store = PromptCacheStore(model, prompt_cache_bytes)
        self.metrics = Metrics()
        self.created = int(time.time())
        self._waiting: deque[Job] = deque()
        self._runs: dict[int, Run] = {}  # decoder uid -> run (engine thread only)
        self._cond = threading.Condition()
        self._closing = False
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
                raise QueueFull("the server is shutting down")
            if len(self._waiting) >= self.max_queue:
                raise QueueFull(f"{len(self._waiting)} requests are already waiting "
                                f"(--max-queue {self.max_queue}); retry later")
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
        _materialize(self.model, self.drafter)
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
            jobs = list(self._waiting) + [r.job for r in list(self._runs.values())]
            self._cond.notify_all()
        for job in jobs:
            self.cancel(job)
        if self._thread.is_alive():
            self._thread.join(timeout)

    # ---- the engine thread ------------------------------------------------------------------

    def _warm_up(self) -> None:
        from .. import decode
        from ..adaptive import verify_seconds

        decode.generate(self.model, self.tokenizer, [self.vocab_size // 2] * 4, None, max_tokens=2)
        if self.drafter is not None and self.num_draft_tokens == "auto":
            verify_seconds(self.model)
            if getattr(self.drafter, "model", None) is not None:
                verify_seconds(self.drafter.model, n_max=1)

    def _loop(self) -> None:
        self._warm_error = None
        try:
            if self._warm_up_first:
                self._warm_up()
        except Exception as e:  # reported by start(), on the caller's thread
            self._warm_error = e
            return
        finally:
            self._warm.set()
        from ..batch import BatchDecoder

        self.decoder = BatchDecoder(self.model, self.tokenizer, max_batch=self.max_batch)
        while True:
            with self._cond:
                while not self._waiting and not self._runs and not self._closing:
                    self._cond.wait()
                if self._closing:
                    for uid in list(self._runs):
                        self._end(uid, "cancelled")
                    return
                while self._waiting and len(self._runs) < self.max_batch:
                    self._admit(self._waiting.popleft())
            self._step()

    def _admit(self, job: Job) -> None:
        """A queued job becomes a row of the decoder (prompt cache fetched, drafter forked)."""
        cache, cached = self.store.fetch(job.prompt)
        drafter = None
        if job.use_drafter and self.drafter is not None:  # its own state, the server drafter's weights
            drafter = self.drafter.fork() if hasattr(self.drafter, "fork") else self.drafter

        def progress(done: int, total: int) -> None:  # between prefill chunks
            if job.cancelled.is_set():
                raise _Cancelled(job)

        try:
            uid = self.decoder.add(job.prompt[cached:], drafter, prompt_cache=cache,
                                   prompt_progress_callback=progress, **job.options)
        except BaseException as e:
            self.store.put(cache)
            self.metrics.request_done("failed")
            job.done = True
            job.send(Failed(e))
            return
        self._runs[uid] = Run(job, cache, cached, drafter, StopCutter(job.stops))

    def _step(self) -> None:
        try:
            events = self.decoder.step()
        except _Cancelled as c:  # a client left during its prefill: its cache is as before
            uid = next(u for u, r in self._runs.items() if r.job is c.args[0])
            return self._end(uid, "cancelled")
        except BaseException as e:  # never let one request end the engine
            log.exception("a decode step failed")
            for uid in list(self._runs):
                self._end(uid, "failed", e)
            return
        if self.decoder.width:
            self.metrics.batch_step(self.decoder.width)
        for uid, block in events:
            run = self._runs[uid]
            for seen, r in enumerate(block, 1):
                run.n, run.last = run.n + 1, r
                text = run.cut.feed(r.text)
                reason = "stop" if run.cut.matched is not None else r.finish_reason
                if r.finish_reason is not None and run.cut.matched is None:
                    text += run.cut.flush()
                run.job.send(Piece(text, r.token, self._logprob(r, run.job.logprobs)))
                if reason is None and run.job.cancelled.is_set():
                    reason = "cancelled"
                if reason is not None:
                    self._end(uid, reason, seen=seen)
                    break
        for uid, run in list(self._runs.items()):  # cancelled while waiting for its prefill
            if run.job.cancelled.is_set() and run.n == 0:
                self._end(uid, "cancelled")

    def _end(self, uid: int, reason: str, error: BaseException | None = None, seen: int | None = None) -> None:
        """Release the row (its cache holds the prompt and the tokens handed out; it goes back to
        the store), count the request and tell its client."""
        run = self._runs.pop(uid)
        try:
            self.decoder.release(uid, seen)
        except BaseException as e:
            error = error or e
        self.store.put(run.cache)
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

    def _logprob(self, r, top: int | None):
        """(token text, log-prob, top n) from the target's log-probabilities at this token."""
        if top is None:
            return None
        import mlx.core as mx

        lp = r.logprobs
        best = []
        if top > 0:
            ids = mx.argpartition(-lp, kth=top - 1)[:top]
            values = lp[ids]
            order = mx.argsort(-values)
            ids, values = ids[order].tolist(), values[order].tolist()
            best = [(self._piece(i), v) for i, v in zip(ids, values)]
        return self._piece(r.token), lp[r.token].item(), best

    def _piece(self, token: int) -> str:
        return self.tokenizer.decode([token])


def _materialize(model, drafter) -> None:
    """Evaluate the weights on the caller's thread: MLX streams belong to a thread, so a lazy
    array made there (a weight edited after loading, a head's derived tensor) cannot be
    evaluated on the engine's."""
    import mlx.core as mx
    import mlx.nn as nn

    found, seen = [], set()

    def walk(obj, depth):
        if id(obj) in seen or depth > 4:
            return
        seen.add(id(obj))
        if isinstance(obj, mx.array):
            found.append(obj)
        elif isinstance(obj, nn.Module):
            found.append(obj.parameters())
            walk(vars(obj), depth + 1)
        elif isinstance(obj, dict):
            for v in obj.values():
                walk(v, depth + 1)
        elif isinstance(obj, (list, tuple)):
            for v in obj:
                walk(v, depth + 1)
        elif hasattr(obj, "__dict__") and not isinstance(obj, type) and depth < 4:
            walk(vars(obj), depth + 1)

    walk(model, 0)
    if drafter is not None:
        walk(drafter, 0)
    mx.eval(found)
