"""Request fields both APIs share, checked before any model work.

`Body` reads one JSON object field by field and answers a wrong type or range
with a 400 naming the field. `generation_options` turns the sampling and
speculation fields into `stream_generate` keywords (mlx-lm's names: `top_k`,
`min_p`, `repetition_penalty`, ...; mlx-spec's `draft` and
`num_draft_tokens`), `chat_prompt` applies the chat template (tools and
`chat_template_kwargs` included) as mlx-lm's server does, and `check_prompt`
refuses prompts the model's context cannot hold.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from ..request import whole
from .errors import invalid

DEFAULT_MAX_TOKENS = 512  # mlx-lm's server default when a request gives none
MAX_STOPS = 16


class Body:
    """A request's JSON object, read one field at a time with its type and range checked."""

    def __init__(self, data: Any):
        if not isinstance(data, dict):
            raise invalid("the request body must be a JSON object")
        self.data = data

    def __contains__(self, name: str) -> bool:
        return self.data.get(name) is not None

    def raw(self, name: str, default=None):
        value = self.data.get(name)
        return default if value is None else value

    def boolean(self, name: str, default: bool = False) -> bool:
        value = self.raw(name, default)
        if not isinstance(value, bool):
            raise invalid(f"'{name}' must be true or false, got {value!r}", name)
        return value

    def number(self, name: str, default: float, low: float, high: float | None = None) -> float:
        value = self.raw(name, default)
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        if not ok or value < low or (high is not None and value > high):
            bound = f"between {low} and {high}" if high is not None else f">= {low}"
            raise invalid(f"'{name}' must be a number {bound}, got {value!r}", name)
        return float(value)

    def integer(self, name: str, default: int | None, low: int, high: int | None = None) -> int | None:
        value = self.raw(name, default)
        if value is None:
            return None
        if not whole(value) or value < low or (
                high is not None and value > high):
            bound = f"between {low} and {high}" if high is not None else f">= {low}"
            raise invalid(f"'{name}' must be an integer {bound}, got {value!r}", name)
        return value

    def string(self, name: str, default: str | None = None) -> str | None:
        value = self.raw(name, default)
        if value is not None and not isinstance(value, str):
            raise invalid(f"'{name}' must be a string, got {type(value).__name__}", name)
        return value

    def mapping(self, name: str) -> dict:
        value = self.raw(name, {})
        if not isinstance(value, dict):
            raise invalid(f"'{name}' must be a JSON object, got {type(value).__name__}", name)
        return value

    def stops(self, name: str) -> tuple[str, ...]:
        value = self.raw(name, [])
        value = [value] if isinstance(value, str) else value
        if not isinstance(value, list) or not all(isinstance(s, str) and s for s in value):
            raise invalid(f"'{name}' must be a non-empty string or a list of them", name)
        if len(value) > MAX_STOPS:
            raise invalid(f"'{name}' takes at most {MAX_STOPS} strings, got {len(value)}", name)
        return tuple(value)


def generation_options(body: Body, engine, *, max_tokens: int) -> tuple[dict, bool]:
    """(stream_generate keywords, whether the loaded drafter runs) from the shared fields."""
    from mlx_lm.sample_utils import make_logits_processors

    top_k = body.integer("top_k", 0, -1)
    options = dict(
        max_tokens=max_tokens,
        temp=body.number("temperature", 0.0, 0.0),
        top_p=body.number("top_p", 1.0, 0.0, 1.0),
        top_k=max(top_k, 0),  # -1 (vLLM) and 0 (mlx-lm) both mean no top-k filter
        min_p=body.number("min_p", 0.0, 0.0, 1.0),
        seed=body.integer("seed", None, -(2**63)),
    )
    if options["top_p"] == 0:  # the nucleus of mass 0 is the top token (mlx-lm would read 0 as no filter)
        options["temp"] = 0.0
    if options["seed"] is not None:
        options["seed"] %= 2**32  # MLX seeds are unsigned 32-bit; a client's may be any integer
    penalties = {name: body.number(name, 0.0, -2.0, 2.0) or None
                 for name in ("presence_penalty", "frequency_penalty")}
    penalties["repetition_penalty"] = body.number("repetition_penalty", 1.0, 0.0)
    if penalties["repetition_penalty"] == 1.0:
        penalties["repetition_penalty"] = None
    bias = _logit_bias(body, engine)
    processors = make_logits_processors(logit_bias=bias, **penalties)
    if processors:  # with how they were made: a sharded server's other ranks make them too
        options["logits_processors"] = Processors(processors, dict(logit_bias=bias, **penalties))
    use_drafter = _draft(body, engine)
    k = body.raw("num_draft_tokens", engine.num_draft_tokens)
    if not (k == "auto" or (whole(k) and 1 <= k <= 16)):
        raise invalid(f"'num_draft_tokens' must be an integer 1..16 or \"auto\", got {k!r}",
                      "num_draft_tokens")
    options["num_draft_tokens"] = k
    return options, use_drafter


class Processors(list):
    """Logits processors, and the `make_logits_processors` keywords that made them."""

    def __init__(self, processors, recipe: dict):
        super().__init__(processors)
        self.recipe = recipe


HISTORY = 1024  # cached prompt tokens a penalty may read (mlx-lm's penalties read the last 20)


def with_history(processors: list, before: list[int]) -> list:
    """`processors` for a request whose prompt starts with `before`, already in its prompt cache:
    they see the tokens the decoder never feeds (a cache hit must not change a penalty's output)."""
    import mlx.core as mx

    prefix = mx.array(before[-HISTORY:], mx.uint32)

    def seeing(proc):
        return lambda tokens, logits: proc(mx.concatenate([prefix, tokens.astype(mx.uint32)]), logits)

    return [seeing(p) for p in processors]


def _draft(body: Body, engine) -> bool:
    kind = body.raw("draft", None)
    if kind is None:
        return engine.drafter is not None
    if kind == "none":
        return False
    if engine.drafter is None:
        raise invalid(f"'draft': this server runs no drafter (it was started with --draft none), "
                      f"so only \"none\" is possible; got {kind!r}", "draft")
    if kind != engine.drafter_kind:
        raise invalid(f"'draft' must be \"none\" or \"{engine.drafter_kind}\" (the drafter this "
                      f"server loaded), got {kind!r}", "draft")
    return True


def _logit_bias(body: Body, engine) -> dict[int, float] | None:
    bias = body.mapping("logit_bias")
    out = {}
    for key, value in bias.items():
        try:
            token = int(key)
        except ValueError:
            raise invalid(f"'logit_bias' keys must be token ids, got {key!r}", "logit_bias") from None
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if not 0 <= token < engine.vocab_size or not (number and -100 <= value <= 100):  # (NaN fails too)
            raise invalid(f"'logit_bias' must map token ids 0..{engine.vocab_size - 1} to numbers in -100..100 "
                          f"(as OpenAI's); got {key!r}: {value!r}", "logit_bias")
        out[token] = float(value)
    return out or None


def text_of(content, where: str, allow=("text",)) -> str:
    """A message's content as one string: a string, or a list of text parts joined."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind not in allow:
                raise invalid(f"{where}: content parts of type {kind!r} are not supported by this "
                              "server (text only)", "messages")
            parts.append(part_text(part, where))
        return "".join(parts)
    raise invalid(f"{where}: 'content' must be a string or a list of text parts", "messages")


def part_text(part: dict, where: str) -> str:
    """A text part's (or block's) `text`, which must be a string."""
    text = part.get("text", "")
    if not isinstance(text, str):
        raise invalid(f"{where}: a text part's 'text' must be a string, got {type(text).__name__}", "messages")
    return text


def chat_prompt(tokenizer, messages: list[dict], tools: list | None, template_kwargs: dict,
                continue_final: bool = False) -> list[int]:
    """Token ids of `messages` (OpenAI-shaped, content already text) through the chat template;
    `continue_final`: the last (assistant) message is continued, not closed (a prefill)."""
    if continue_final and messages[-1].get("role") != "assistant":
        raise invalid("continuing the final message needs an assistant message last", "messages")
    if not tokenizer.has_chat_template:
        if continue_final:
            raise invalid("this model has no chat template to continue an assistant message with", "messages")
        from mlx_lm.server import convert_chat  # mlx-lm's plain "USER: ... ASSISTANT:" layout

        return tokenizer.encode(convert_chat(messages))
    turn = dict(add_generation_prompt=False, continue_final_message=True) if continue_final else \
        dict(add_generation_prompt=True)
    try:
        ids = tokenizer.apply_chat_template(messages, tools=tools or None, tokenize=True,
                                            **{**template_kwargs, **turn})
    except Exception as e:  # the template itself raises on messages it does not accept
        raise invalid(f"the model's chat template refused these messages: {e}", "messages") from e
    return list(ids["input_ids"] if isinstance(ids, dict) else ids)


def tool_arguments_as_objects(message: dict) -> dict:
    """OpenAI sends a tool call's arguments as a JSON string; chat templates expect an object."""
    calls = message.get("tool_calls")
    if not calls:
        return message
    shape = "'tool_calls' must be a list of {id, type, function: {name, arguments}}"
    if not isinstance(calls, list) or not all(isinstance(c, dict) for c in calls):
        raise invalid(shape, "messages")
    fixed = []
    for call in calls:
        if not isinstance(call.get("function") or {}, dict):
            raise invalid(shape, "messages")
        fn = dict(call.get("function") or {})
        args = fn.get("arguments")
        if isinstance(args, str):
            try:
                fn["arguments"] = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError:
                raise invalid("a tool call's 'arguments' must be a JSON object (as a string)",
                              "messages") from None
        fixed.append({**call, "function": fn})
    return {**message, "tool_calls": fixed}


def context_length(model) -> int | None:
    """The longest sequence the model's config allows, if it says."""
    args = getattr(model, "args", None)
    for source in (args, getattr(args, "text_config", None)):
        if isinstance(source, dict):
            source = type("Args", (), source)
        for name in ("max_position_embeddings", "max_seq_len", "max_sequence_length", "n_positions"):
            value = getattr(source, name, None)
            if isinstance(value, int) and value > 0:
                return value
    return None


def check_prompt(prompt: list[int], max_tokens: int, engine, param: str = "messages") -> int:
    """Refuse a prompt the context cannot hold; return max_tokens cut to the room left.
    `param`: the request field that holds the prompt."""
    if not prompt:
        raise invalid("the prompt is empty: give at least one token of text", param)
    limit = engine.context_length
    if limit is None:
        return max_tokens
    if len(prompt) >= limit:
        raise invalid(f"the prompt has {len(prompt)} tokens and this model's context holds "
                      f"{limit}; shorten the conversation (or start a new one)", param)
    return min(max_tokens, limit - len(prompt))


@dataclass
class Call:
    """A checked request: what the engine runs and how the answer is shaped."""

    prompt: list[int]
    options: dict  # stream_generate keywords
    use_drafter: bool
    model: str
    stream: bool = False
    stops: tuple[str, ...] = ()
    logprobs: int | None = None
    include_usage: bool = False
    tools: list | None = None
    chat: bool = True  # route reasoning and tool calls (chat), or plain text (completions)
    one_tool_call: bool = False  # parallel calls turned off: the answer's first call alone


def model_name(body: Body, engine) -> str:
    """The requested model: the served one (or none named); anything else is a 404."""
    name = body.string("model")
    if name is not None and name != engine.model_id:
        from .errors import ApiError

        raise ApiError(404, f"model {name!r} is not served here; this server serves "
                            f"{engine.model_id!r} (see GET /v1/models)", "model", "model_not_found")
    return engine.model_id


def validate(call: Call, engine) -> Call:
    """The library's own checks of prompt and options, answered as 400s before any model work."""
    from ..request import make_request

    try:
        make_request(engine.model, engine.tokenizer, call.prompt, **call.options)
    except (ValueError, TypeError) as e:
        raise invalid(str(e)) from e
    return call
