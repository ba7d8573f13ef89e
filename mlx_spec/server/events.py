"""A request for the engine (`Job`), and what the engine sends back for it: pieces of text,
then how it finished.

`Usage` is what one request cost (tokens, times, speculation statistics), in the
shapes the APIs report it: OpenAI's `usage`, llama.cpp's `timings`, and
mlx-spec's own `speculative` block.
"""

from __future__ import annotations

import asyncio
import threading
import uuid
from dataclasses import dataclass, field


# Drafter classes -> the kind a request names in `draft`
KINDS = {"NGramDrafter": "ngram", "DraftModelDrafter": "draft-model", "EagleDrafter": "eagle",
         "MTPDrafter": "mtp", "DFlashDrafter": "dflash", "DSparkDrafter": "dspark",
         "V4DSparkDrafter": "dspark"}


def drafter_kind(drafter) -> str | None:
    if drafter is None:
        return None
    name = type(drafter).__name__
    return KINDS.get(name, name.removesuffix("Drafter").lower())


@dataclass
class Piece:
    """One generated token: the text it releases (after stop strings) and its log-probs."""

    text: str
    token: int
    logprob: tuple | None = None  # (token text, log-prob, [(text, log-prob), ...] top n)


def logprob(tokenizer, r, top: int | None):
    """A `Piece`'s log-probs: (token text, log-prob, top n) from the target's log-probabilities
    at response `r` (None when the request asked for none)."""
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
        best = [(tokenizer.decode([i]), v) for i, v in zip(ids, values)]
    return tokenizer.decode([r.token]), lp[r.token].item(), best


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
        self.cached = 0  # prompt tokens served from the prompt cache: set by the engine at admission

    def send(self, event) -> None:
        """From the engine thread: hand `event` to the waiting handler."""
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the event loop is gone (server shutting down)
            self.cancelled.set()

    async def next(self):
        return await self.events.get()
