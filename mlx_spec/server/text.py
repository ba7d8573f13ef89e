"""Generated text on its way to the client: stop strings, reasoning and tool calls.

`StopCutter` runs on the engine thread, token by token: a stop string that ends
inside a verified block cuts the text exactly before it, and the engine stops
asking for tokens, so nothing after it is generated or sent. Text that could
still become a stop string is held back until the next token decides.

`Router` runs per response on the event loop: it splits text into content,
reasoning and tool calls with mlx-lm's own `TextStateMachine` (built by
`make_text_state_machine` from the tokenizer's think and tool-call markers) and
parses tool calls with the tokenizer's `tool_parser`, as mlx-lm's server does.
Reasoning reaches the client as mlx-lm sends it (`reasoning` in OpenAI
messages and deltas; a `thinking` block on `/v1/messages`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Sequence

log = logging.getLogger("mlx_spec.server")


class StopCutter:
    """Cut text at the first of `stops`, holding back what may be the start of one."""

    def __init__(self, stops: Sequence[str] = ()):
        self.stops = tuple(s for s in stops if s)
        self.pending = ""
        self.matched: str | None = None  # the stop string found, once found

    def feed(self, text: str) -> str:
        """The text that can be sent now (after a stop string was found: nothing, ever)."""
        if self.matched is not None or not self.stops:
            return "" if self.matched is not None else text
        buf = self.pending + text
        found = [(buf.find(s), s) for s in self.stops if s in buf]
        if found:
            at, self.matched = min(found, key=lambda f: (f[0], -len(f[1])))
            self.pending = ""
            return buf[:at]
        keep = self._partial(buf)
        self.pending = buf[len(buf) - keep:] if keep else ""
        return buf[: len(buf) - keep]

    def _partial(self, buf: str) -> int:
        """Length of the longest end of `buf` that begins some stop string."""
        best = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(buf)), best, -1):
                if buf.endswith(s[:n]):
                    best = n
                    break
        return best

    def flush(self) -> str:
        """What was held back, once generation ended without a stop string."""
        out, self.pending = self.pending, ""
        return out


@dataclass
class Routed:
    """One piece of output split by kind."""

    content: str = ""
    reasoning: str = ""
    tool_calls: list[dict] = field(default_factory=list)  # {"name", "arguments": object, "id"?}

    def __bool__(self) -> bool:
        return bool(self.content or self.reasoning or self.tool_calls)


class Router:
    """Content, reasoning and tool calls of one response, from its text as it streams."""

    def __init__(self, tokenizer, machine, prompt: Sequence[int], tools: list | None, single: bool = False):
        from mlx_lm.generate import TextStateMachine

        self._sm = TextStateMachine
        self.initial = initial_state(tokenizer, prompt)
        self.state = machine.make_state(self.initial)
        self.prev = self.initial
        self.parser = tokenizer.tool_parser if tokenizer.has_tool_calling else None
        self.tools = tools
        self.tool_text = ""
        self.called = False  # a tool call was made
        self.single = single  # one call at most (parallel tool calls turned off)

    @property
    def in_tool(self) -> bool:
        return self.prev == "tool"

    def feed(self, text: str, end: str | None = None) -> Routed:
        """Route `text`; `end` is "eos" (drop a half-read marker, as mlx-lm) or "flush"."""
        out = Routed()
        if self.state[0] is None:  # the response format ended the response
            return out
        self.state, segments = self._sm.split(self.state, text)
        if end == "eos":
            self.state, current = self._sm.discard(self.state)
            segments.append((current, ""))
        elif end is not None:
            self.state, rest, current = self._sm.flush(self.state)
            segments.append((current, rest))
        for state, piece in segments:
            if self.prev == "tool" and state != "tool":
                self._close_tool(out)
            if state == "reasoning":
                out.reasoning += piece
            elif state == "tool":
                self.tool_text += piece
            elif state is not None:
                out.content += piece
            self.prev = state
        if end is not None and self.prev == "tool" and self.tool_text:
            self._close_tool(out)  # cut off inside a call: parse what there is
        return out

    def _close_tool(self, out: Routed) -> None:
        text, self.tool_text = self.tool_text, ""
        if self.parser is None:
            out.content += text
            return
        try:
            parsed = self.parser(text, self.tools)
        except Exception as e:  # a call cut short by max_tokens, or text that is no call
            log.warning("could not parse a tool call (%s: %s); sent as text", type(e).__name__, e)
            out.content += text
            return
        calls = parsed if isinstance(parsed, list) else [parsed]
        if self.single:  # the first call the answer makes, and no other
            calls = [] if self.called else calls[:1]
        out.tool_calls.extend(calls)
        self.called = True


def initial_state(tokenizer, prompt: Sequence[int]) -> str:
    """"reasoning" when the prompt ends inside an open think block (as mlx-lm decides)."""
    state = "normal"
    if tokenizer.has_thinking:
        prompt = list(prompt)
        if tokenizer.rfind_think_start(prompt) > tokenizer.rfind_think_end(prompt):
            state = "reasoning"
    return getattr(tokenizer, "response_initial_state", None) or state


def make_machine(tokenizer):
    """mlx-lm's text state machine for this tokenizer (built once per server)."""
    from mlx_lm.generate import make_text_state_machine

    return make_text_state_machine(tokenizer)
