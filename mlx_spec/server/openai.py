"""OpenAI's `/v1/chat/completions` and `/v1/completions`: request parsing and response shapes.

Shapes follow https://platform.openai.com/docs/api-reference/chat and
https://platform.openai.com/docs/api-reference/completions. A stream is
server-sent events, `data: {chunk}` each: chat chunks are
`chat.completion.chunk` objects (the first delta carries the role, the last the
`finish_reason`); with `stream_options.include_usage` every chunk has
`"usage": null` and one more chunk with `"choices": []` carries the usage; then
`data: [DONE]`. Beside `usage`, the final body (or that usage chunk) carries
llama.cpp's `timings` and mlx-spec's `speculative` statistics (engine.Usage).
Reasoning goes in `reasoning` and tool calls in `tool_calls`, as mlx-lm's
server sends them.
"""

from __future__ import annotations

import json
import time
import uuid

from .engine import Failed, Finished, Piece
from .errors import INTERNAL, ApiError, invalid, shut_down
from .params import (DEFAULT_MAX_TOKENS, Body, Call, chat_prompt, check_prompt, generation_options,
                     model_name, text_of, tool_arguments_as_objects, validate)
from .text import Routed, Router

ROLES = {"system", "developer", "user", "assistant", "tool"}
FINGERPRINT = "mlx-spec"


def parse_chat(body: Body, engine) -> Call:
    model = model_name(body, engine)
    messages = body.raw("messages")
    if not isinstance(messages, list) or not messages:
        raise invalid("'messages' must be a non-empty list of {role, content} objects", "messages")
    chat = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise invalid(f"messages[{i}] must be an object whose 'role' is one of "
                          f"{sorted(ROLES)}", "messages")
        out = {k: m[k] for k in ("name", "tool_calls", "tool_call_id") if m.get(k) is not None}
        out["role"] = "system" if m["role"] == "developer" else m["role"]
        out["content"] = text_of(m.get("content"), f"messages[{i}]")
        chat.append(tool_arguments_as_objects(out))
    _only_one(body)
    modalities = body.raw("modalities", ["text"])
    if body.raw("audio") is not None or not isinstance(modalities, list) or any(m != "text" for m in modalities):
        raise invalid("only text comes out of this server ('modalities' [\"text\"], no 'audio')", "modalities")
    tools = _tools(body)
    fmt = body.mapping("response_format").get("type", "text")
    if fmt != "text":
        raise invalid(f"'response_format' {fmt!r} is not supported (no constrained decoding); "
                      "ask for JSON in the prompt instead", "response_format")
    prompt = chat_prompt(engine.tokenizer, chat, tools, body.mapping("chat_template_kwargs"),
                         continue_final=body.boolean("continue_final_message"))  # (vLLM's field)
    limit = body.integer("max_completion_tokens", None, 1) or body.integer("max_tokens", None, 1)
    options, use = generation_options(body, engine,
                                      max_tokens=check_prompt(prompt, limit or DEFAULT_MAX_TOKENS, engine))
    top = body.integer("top_logprobs", 0, 0, 20)
    logprobs = body.boolean("logprobs")
    if top and not logprobs:
        raise invalid("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    return validate(Call(prompt, options, use, model, body.boolean("stream"), body.stops("stop"),
                         top if logprobs else None, _include_usage(body), tools,
                         one_tool_call=not body.boolean("parallel_tool_calls", True)), engine)


def parse_completion(body: Body, engine) -> Call:
    from ..request import encode

    model = model_name(body, engine)
    prompt = body.raw("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if not (isinstance(prompt, str) or (isinstance(prompt, list) and prompt
                                        and all(isinstance(t, int) for t in prompt))):
        raise invalid("'prompt' must be a string or a list of token ids (one prompt per request)",
                      "prompt")
    for name in ("echo",):
        if body.boolean(name):
            raise invalid(f"'{name}' is not supported by this server", name)
    if "suffix" in body:
        raise invalid("'suffix' (fill-in-the-middle) is not supported by this server", "suffix")
    _only_one(body, "best_of")
    try:
        ids = encode(engine.tokenizer, prompt)
    except ValueError as e:
        raise invalid(str(e), "prompt") from e
    limit = body.integer("max_tokens", None, 1) or DEFAULT_MAX_TOKENS
    options, use = generation_options(body, engine, max_tokens=check_prompt(ids, limit, engine, "prompt"))
    logprobs = body.integer("logprobs", None, 0, 5)
    return validate(Call(ids, options, use, model, body.boolean("stream"), body.stops("stop"),
                         logprobs, _include_usage(body), chat=False), engine)


def _only_one(body: Body, *names: str) -> None:
    for name in ("n", *names):
        if body.integer(name, 1, 1) != 1:
            raise invalid(f"'{name}' must be 1: this server returns one choice per request", name)


def _include_usage(body: Body) -> bool:
    return bool(body.mapping("stream_options").get("include_usage"))


def _tools(body: Body) -> list | None:
    tools, choice = body.raw("tools"), body.raw("tool_choice", "auto")
    for old in ("functions", "function_call"):  # (answering them would need their older reply shape too)
        if body.raw(old) is not None:
            raise invalid(f"'{old}' (OpenAI's deprecated form of tools) is not supported: send 'tools' "
                          "and 'tool_choice'", old)
    if choice not in ("auto", "none"):  # with tools or without (a forced call of no tool)
        raise invalid("'tool_choice' may be \"auto\" or \"none\": forcing a call needs constrained "
                      "decoding, which this server does not do", "tool_choice")
    if tools is None:
        return None
    if not isinstance(tools, list) or not all(
            isinstance(t, dict) and isinstance(t.get("function"), dict) and t["function"].get("name")
            for t in tools):
        raise invalid("'tools' must be a list of {type: function, function: {name, ...}}", "tools")
    return None if choice == "none" else tools


# ---- responses -------------------------------------------------------------------------------


class Reply:
    """The response to one call, built from the engine's events."""

    def __init__(self, call: Call, engine):
        self.call, self.engine = call, engine
        self.chat = call.chat
        self.id = f"{'chatcmpl' if self.chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.router = Router(engine.tokenizer, engine.machine, call.prompt, call.tools,
                             call.one_tool_call) if self.chat else None
        self.index = 0  # streamed tool calls
        self.offset = 0  # legacy completions: where the next token's text starts in the answer

    def head(self, kind: str) -> dict:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.call.model,
                "system_fingerprint": FINGERPRINT}

    def route(self, text: str, end: str | None = None) -> Routed:
        if self.router is None:
            return Routed(content=text)
        return self.router.feed(text, end)

    def finish_reason(self, done: Finished) -> str:
        if done.reason == "stop" and self.router is not None and self.router.called:
            return "tool_calls"
        return "length" if done.reason == "length" else "stop"

    def tool_calls(self, calls: list[dict], stream: bool) -> list[dict]:
        out = []
        for c in calls:
            args = c.get("arguments", {})
            item = {"id": c.get("id") or f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                    "function": {"name": c.get("name"), "arguments":
                                 args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)}}
            if stream:
                item["index"] = self.index
                self.index += 1
            out.append(item)
        return out

    def logprobs(self, pieces: list[Piece]):
        if self.call.logprobs is None:
            return None
        entries = [p.logprob for p in pieces if p.logprob is not None]
        if self.chat:
            return {"content": [dict(_lp(t, v), top_logprobs=[_lp(a, b) for a, b in top])
                                for t, v, top in entries]}
        offsets = []  # into the answer's text as sent (each token's piece of it, after stop cuts)
        for p in pieces:
            if p.logprob is not None:
                offsets.append(self.offset)
                self.offset += len(p.text)
        return {"tokens": [t for t, _, _ in entries], "token_logprobs": [v for _, v, _ in entries],
                "top_logprobs": [{a: b for a, b in top} for _, _, top in entries], "text_offset": offsets}

    def stats(self, done: Finished) -> dict:
        u = done.usage
        return {"usage": u.usage(), "timings": u.timings(), "speculative": u.speculative()}

    # ---- one JSON body ------------------------------------------------------------------------

    async def body(self, job) -> dict:
        pieces, out = [], Routed()
        while True:
            event = await job.next()
            if isinstance(event, Failed):
                raise ApiError(500, INTERNAL)
            if (stopped := shut_down(event)) is not None:
                raise stopped
            end = _end(event) if isinstance(event, Finished) else None
            text = event.text if isinstance(event, Piece) else ""
            if isinstance(event, Piece):
                pieces.append(event)
            r = self.route(text, end)
            out.content, out.reasoning = out.content + r.content, out.reasoning + r.reasoning
            out.tool_calls += r.tool_calls
            if isinstance(event, Finished):
                break
        choice = {"index": 0, "finish_reason": self.finish_reason(event),
                  "logprobs": self.logprobs(pieces)}
        if self.chat:
            message = {"role": "assistant", "content": None if out.tool_calls and not out.content else out.content}
            if out.reasoning:
                message["reasoning"] = out.reasoning
            if out.tool_calls:
                message["tool_calls"] = self.tool_calls(out.tool_calls, stream=False)
            choice["message"] = message
        else:
            choice["text"] = out.content
        return {**self.head("chat.completion" if self.chat else "text_completion"),
                "choices": [choice], **self.stats(event)}

    # ---- server-sent events -------------------------------------------------------------------

    async def events(self, job):
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        usage = {"usage": None} if self.call.include_usage else {}

        def chunk(delta: dict | None, finish=None, logprobs=None) -> bytes:
            choice = {"index": 0, "finish_reason": finish, "logprobs": logprobs}
            choice.update({"delta": delta} if self.chat else {"text": (delta or {}).get("content", "")})
            return _sse({**self.head(kind), "choices": [choice], **usage})

        if self.chat:
            yield chunk({"role": "assistant", "content": ""})
        while True:
            event = await job.next()
            if isinstance(event, Failed):
                yield _sse(ApiError(500, INTERNAL).openai())
                return
            if (stopped := shut_down(event)) is not None:
                yield _sse(stopped.openai())
                return
            piece = event if isinstance(event, Piece) else None
            r = self.route(piece.text if piece else "", _end(event) if piece is None else None)
            lp = self.logprobs([piece]) if piece is not None else None
            if r or (lp and lp.get("content", lp.get("tokens"))):
                delta = {}
                if r.content:
                    delta["content"] = r.content
                if r.reasoning:
                    delta["reasoning"] = r.reasoning
                if r.tool_calls:
                    delta["tool_calls"] = self.tool_calls(r.tool_calls, stream=True)
                yield chunk(delta, logprobs=lp)
            if isinstance(event, Finished):
                yield chunk({}, self.finish_reason(event))
                if self.call.include_usage:
                    yield _sse({**self.head(kind), "choices": [], **self.stats(event)})
                yield b"data: [DONE]\n\n"
                return


def _end(done: Finished) -> str:
    """How the text router ends: at EOS a half-read marker is dropped (as mlx-lm), else kept."""
    return "eos" if done.reason == "stop" and done.stop_sequence is None else "flush"


def _lp(token: str, logprob: float) -> dict:
    return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}


def _sse(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"
