"""Anthropic's Messages API, `POST /v1/messages`: request parsing and response shapes.

Shapes follow https://docs.anthropic.com/en/api/messages and, for streams,
https://docs.anthropic.com/en/docs/build-with-claude/streaming: `message_start`,
then per content block `content_block_start`, `content_block_delta`s
(`text_delta`, `thinking_delta`, `input_json_delta`) and `content_block_stop`,
then `message_delta` (stop reason and usage) and `message_stop`. Messages,
`system`, tool uses and tool results become the chat template's messages, so
agents that speak Anthropic run on any local model. Cached prompt tokens are
reported as `cache_read_input_tokens` (Anthropic's `input_tokens` counts only
the others), in `message_start` as at the end; `timings` and `speculative` ride the final body or
`message_delta`, as on the OpenAI routes.
"""

from __future__ import annotations

import json
import uuid

from .engine import Failed, Finished, Piece
from .errors import INTERNAL, ApiError, invalid, shut_down
from .params import (Body, Call, chat_prompt, check_prompt, generation_options, model_name, part_text, text_of,
                     validate)
from .text import Router

DEFAULT_TEMPERATURE = 1.0  # Anthropic's documented default


def parse_messages(body: Body, engine) -> Call:
    model = model_name(body, engine)
    max_tokens = body.integer("max_tokens", None, 1)
    if max_tokens is None:
        raise invalid("'max_tokens' is required (an integer >= 1)", "max_tokens")
    prompt, tools = _prompt(body, engine)
    if "temperature" not in body:
        body.data["temperature"] = DEFAULT_TEMPERATURE
    options, use = generation_options(body, engine, max_tokens=check_prompt(prompt, max_tokens, engine))
    single = body.mapping("tool_choice").get("disable_parallel_tool_use") is True
    return validate(Call(prompt, options, use, model, body.boolean("stream"),
                         body.stops("stop_sequences"), None, True, tools, one_tool_call=single), engine)


def _prompt(body: Body, engine) -> tuple[list[int], list | None]:
    """The request's token ids through the chat template (system, messages, tools, thinking),
    and its tools."""
    messages = body.raw("messages")
    if not isinstance(messages, list) or not messages:
        raise invalid("'messages' must be a non-empty list of {role, content} objects", "messages")
    chat = []
    system = text_of(body.raw("system"), "system")
    if system:
        chat.append({"role": "system", "content": system})
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
            raise invalid(f"messages[{i}] must be an object whose 'role' is user or assistant", "messages")
        chat.extend(_message(m, i))
    tools = _tools(body)
    kwargs = dict(body.mapping("chat_template_kwargs"))
    thinking = body.mapping("thinking").get("type")
    if thinking is not None and engine.tokenizer.has_thinking:
        kwargs.setdefault("enable_thinking", thinking != "disabled")
    # A last assistant message is a prefill (Anthropic's API): the answer continues it.
    prefill = chat[-1]["role"] == "assistant" and not chat[-1].get("tool_calls")
    return chat_prompt(engine.tokenizer, chat, tools, kwargs, continue_final=prefill), tools


def _message(m: dict, i: int) -> list[dict]:
    """One Anthropic message as chat-template messages (tool results become `tool` messages)."""
    role, content = m["role"], m.get("content")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise invalid(f"messages[{i}].content must be a string or a list of blocks", "messages")
    out, text, calls = [], [], []
    for block in content:
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            text.append(part_text(block, f"messages[{i}]"))
        elif kind == "tool_use" and role == "assistant":
            calls.append({"id": block.get("id"), "type": "function",
                          "function": {"name": block.get("name"), "arguments": block.get("input") or {}}})
        elif kind == "tool_result" and role == "user":
            result = text_of(block.get("content"), f"messages[{i}] tool_result")
            out.append({"role": "tool", "tool_call_id": block.get("tool_use_id"), "content": result})
        elif kind in ("thinking", "redacted_thinking"):
            continue  # earlier reasoning: chat templates drop it from past turns anyway
        else:
            raise invalid(f"messages[{i}]: content blocks of type {kind!r} are not supported by "
                          "this server (text, tool_use, tool_result, thinking)", "messages")
    if text or calls or not out:
        message = {"role": role, "content": "".join(text)}
        if calls:
            message["tool_calls"] = calls
        out.append(message)
    return out


def _tools(body: Body) -> list | None:
    tools, choice = body.raw("tools"), body.mapping("tool_choice").get("type", "auto")
    if choice not in ("auto", "none"):  # with tools or without (a forced call of no tool)
        raise invalid("'tool_choice' may be auto or none: forcing a tool needs constrained "
                      "decoding, which this server does not do", "tool_choice")
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise invalid("'tools' must be a list of {name, description, input_schema}", "tools")
    out = []
    for t in tools:
        if not isinstance(t, dict) or not t.get("name") or t.get("type") not in (None, "custom"):
            raise invalid("'tools' must be custom tools {name, description, input_schema}; "
                          "Anthropic's server tools do not run here", "tools")
        out.append({"type": "function", "function": {
            "name": t["name"], "description": t.get("description", ""),
            "parameters": t.get("input_schema") or {"type": "object", "properties": {}}}})
    return None if choice == "none" else out


def count_tokens(body: Body, engine) -> dict:
    """`POST /v1/messages/count_tokens`: the prompt's length after the chat template, also for
    a prompt longer than the context (a client counts to know when to shorten)."""
    model_name(body, engine)
    return {"input_tokens": len(_prompt(body, engine)[0])}


class Reply:
    """The Messages API answer to one call, built from the engine's events."""

    def __init__(self, call: Call, engine):
        self.call = call
        self.id = f"msg_{uuid.uuid4().hex[:24]}"
        self.router = Router(engine.tokenizer, engine.machine, call.prompt, call.tools, call.one_tool_call)

    def message(self, content: list, done: Finished | None, cached: int = 0) -> dict:
        u = done.usage if done else None
        out = {"id": self.id, "type": "message", "role": "assistant", "model": self.call.model,
               "content": content, "stop_reason": self.stop_reason(done) if done else None,
               "stop_sequence": done.stop_sequence if done else None, "usage": self.usage(done, cached)}
        if u is not None:
            out.update(timings=u.timings(), speculative=u.speculative())
        return out

    def usage(self, done: Finished | None, cached: int = 0) -> dict:
        """Anthropic's `usage`; before the end (`message_start`), with the prompt cache's share
        `cached` as the engine found it."""
        prompt, out = len(self.call.prompt), 0
        if done is not None:
            prompt, cached, out = done.usage.prompt_tokens, done.usage.cached_tokens, done.usage.completion_tokens
        return {"input_tokens": prompt - cached, "output_tokens": out,
                "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}

    def stop_reason(self, done: Finished) -> str:
        if done.stop_sequence is not None:
            return "stop_sequence"
        if done.reason == "length":
            return "max_tokens"
        return "tool_use" if self.router.called else "end_turn"

    def route(self, event):
        if isinstance(event, Piece):
            return self.router.feed(event.text)
        eos = event.reason == "stop" and event.stop_sequence is None
        return self.router.feed("", "eos" if eos else "flush")

    async def body(self, job) -> dict:
        blocks: list[dict] = []

        def add(kind: str, key: str, text: str):
            if not text:
                return
            if blocks and blocks[-1]["type"] == kind:
                blocks[-1][key] += text
            else:
                blocks.append({"type": kind, key: text, **({"signature": ""} if kind == "thinking" else {})})

        while True:
            event = await job.next()
            if isinstance(event, Failed):
                raise ApiError(500, INTERNAL)
            if (stopped := shut_down(event)) is not None:
                raise stopped
            r = self.route(event)
            add("thinking", "thinking", r.reasoning)
            add("text", "text", r.content)
            blocks += [_tool_block(c) for c in r.tool_calls]
            if isinstance(event, Finished):
                return self.message(blocks, event)

    async def events(self, job):
        # `message_start` waits for the job's first event: by then the engine has looked the
        # prompt up in its cache, so its usage splits the prompt as `message_delta`'s does.
        event = await job.next()
        yield _event("message_start", {"type": "message_start", "message": self.message([], None, job.cached)})
        yield _event("ping", {"type": "ping"})
        index, open_kind = -1, None

        def start(block: dict):
            nonlocal index, open_kind
            out = stop()
            index, open_kind = index + 1, block["type"]
            return out + _event("content_block_start", {"type": "content_block_start", "index": index,
                                                        "content_block": block})

        def stop() -> bytes:
            nonlocal open_kind
            if open_kind is None:
                return b""
            open_kind = None
            return _event("content_block_stop", {"type": "content_block_stop", "index": index})

        def delta(body: dict) -> bytes:
            return _event("content_block_delta", {"type": "content_block_delta", "index": index, "delta": body})

        while True:
            if isinstance(event, Failed):
                yield _event("error", ApiError(500, INTERNAL).anthropic())
                return
            if (stopped := shut_down(event)) is not None:
                yield _event("error", stopped.anthropic())
                return
            r, out = self.route(event), b""
            if r.reasoning:
                if open_kind != "thinking":
                    out += start({"type": "thinking", "thinking": "", "signature": ""})
                out += delta({"type": "thinking_delta", "thinking": r.reasoning})
            if r.content:
                if open_kind != "text":
                    out += start({"type": "text", "text": ""})
                out += delta({"type": "text_delta", "text": r.content})
            for call in r.tool_calls:
                block = _tool_block(call)
                out += start({**block, "input": {}})
                out += delta({"type": "input_json_delta", "partial_json": json.dumps(block["input"])})
            if out:
                yield out
            if isinstance(event, Finished):
                final = {"type": "message_delta", "delta": {"stop_reason": self.stop_reason(event),
                                                            "stop_sequence": event.stop_sequence},
                         "usage": self.usage(event), "timings": event.usage.timings(),
                         "speculative": event.usage.speculative()}
                yield stop() + _event("message_delta", final) + _event("message_stop", {"type": "message_stop"})
                return
            event = await job.next()


def _tool_block(call: dict) -> dict:
    args = call.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            args = {"arguments": args}
    return {"type": "tool_use", "id": call.get("id") or f"toolu_{uuid.uuid4().hex[:24]}",
            "name": call.get("name"), "input": args}


def _event(name: str, data: dict) -> bytes:
    return f"event: {name}\ndata: ".encode() + json.dumps(data, ensure_ascii=False).encode() + b"\n\n"
