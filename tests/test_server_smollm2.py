"""`mlx-spec serve` with a real model and tokenizer (SmolLM2-135M-Instruct, float32) and the
n-gram drafter, driven by the official `openai` and `anthropic` clients: the chat template,
stop strings in real text cut inside verified blocks, a second turn served from the prompt
cache exactly as a cold server serves it, seeded sampling, and the Anthropic Messages API."""

from __future__ import annotations

import anthropic
import openai
import pytest

import mlx_spec
from server_utils import post, running_server

pytestmark = pytest.mark.slow

COPY = [{"role": "user", "content": "Copy this list exactly, one item per line: apples, pears, "
                                    "plums, cherries, figs, grapes, lemons, limes."}]


@pytest.fixture(scope="module")
def server(smollm2):
    model, tok = smollm2
    with running_server(model, tok, mlx_spec.NGramDrafter(), num_draft_tokens=4,
                        model_id="smollm2") as s:
        s.model, s.tok = model, tok
        s.openai = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        s.anthropic = anthropic.Anthropic(base_url=s.url, api_key="unused", max_retries=0, timeout=120)
        yield s


def ask(s, messages=COPY, stream=False, **kw):
    """(text, the response or its chunks) of a greedy chat completion."""
    kw = {"model": "smollm2", "messages": messages, "max_tokens": 32, "temperature": 0, **kw}
    if not stream:
        r = s.openai.chat.completions.create(**kw)
        return r.choices[0].message.content, r
    chunks = list(s.openai.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices), chunks


def test_chat_output_is_generate_on_the_templated_prompt_streamed_or_not(server):
    ids = server.tok.apply_chat_template(COPY, add_generation_prompt=True)
    out = list(mlx_spec.stream_generate(server.model, server.tok, ids, None, max_tokens=32))
    want = "".join(r.text for r in out)
    plain, r = ask(server)
    streamed, chunks = ask(server, stream=True)
    assert plain == streamed == want
    assert r.usage.prompt_tokens == len(ids) and r.model_extra["speculative"]["accepted"] > 0
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == len(out) and "timings" in chunks[-1].model_extra
    prompt = "The capital of France is"
    done = server.openai.completions.create(model="smollm2", prompt=prompt, max_tokens=8, temperature=0)
    assert done.choices[0].text == mlx_spec.generate(server.model, server.tok, prompt, None, max_tokens=8)


def test_a_stop_string_inside_a_verified_block_cuts_the_text_exactly_there(server):
    ids = server.tok.apply_chat_template(COPY, add_generation_prompt=True)
    out = list(mlx_spec.stream_generate(server.model, server.tok, ids, mlx_spec.NGramDrafter(),
                                        max_tokens=32, num_draft_tokens=4))
    texts = [r.text for r in out]
    full = "".join(texts)
    # token i is a kept draft (more of its block follows) whose text appears there first
    i = next(i for i in range(1, len(out) - 1) if out[i].from_draft and len(texts[i].strip()) > 2
             and full.find(texts[i]) == len("".join(texts[:i])))
    stop = texts[i]
    server.engine.store.clear()  # cold, so the server's blocks are the run's above
    text, r = ask(server, stop=[stop, "never appears"])
    assert text == "".join(texts[:i]) and r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens == i + 1  # the token that completed the stop string
    server.engine.store.clear()
    streamed, chunks = ask(server, stream=True, stop=[stop])
    assert streamed == text and stop not in "".join(str(c) for c in chunks)
    server.engine.store.clear()
    m = server.anthropic.messages.create(model="smollm2", max_tokens=32, messages=COPY,
                                         stop_sequences=[stop], extra_body={"temperature": 0})
    assert m.content[0].text == text and m.stop_reason == "stop_sequence" and m.stop_sequence == stop


def test_a_second_turn_comes_from_the_cache_and_equals_a_cold_servers_answer(server):
    first, _ = ask(server, max_tokens=24)
    turn2 = COPY + [{"role": "assistant", "content": first},
                    {"role": "user", "content": "Now say it once more, in capitals."}]
    warm, r = ask(server, turn2, max_tokens=24)
    cached = r.usage.prompt_tokens_details.cached_tokens
    assert cached > r.usage.prompt_tokens // 2 and r.model_extra["timings"]["cache_n"] == cached
    server.engine.store.clear()  # what a freshly started server holds
    cold, r = ask(server, turn2, max_tokens=24)
    assert r.usage.prompt_tokens_details.cached_tokens == 0 and cold == warm


def test_seeded_sampling_repeats_and_other_seeds_differ(server):
    kw = dict(messages=[{"role": "user", "content": "Write a short poem about the sea."}],
              temperature=0.9, top_p=0.95, max_tokens=16)
    a, _ = ask(server, seed=7, **kw)
    b, _ = ask(server, seed=7, stream=True, **kw)
    assert a == b
    others = {ask(server, seed=seed, **kw)[0] for seed in (1, 2)}
    assert others != {a}


def test_anthropic_messages_plain_and_streamed_equal_the_openai_answer(server):
    system = "You are a concise assistant."
    messages = [{"role": "user", "content": "Name three colours."}]
    want, _ = ask(server, [{"role": "system", "content": system}] + messages, max_tokens=20)
    kw = dict(model="smollm2", max_tokens=20, system=system, messages=messages, extra_body={"temperature": 0})
    m = server.anthropic.messages.create(**kw)
    assert [b.type for b in m.content] == ["text"] and m.content[0].text == want
    assert m.stop_reason in ("end_turn", "max_tokens") and m.usage.output_tokens <= 20
    assert m.usage.cache_read_input_tokens > 0  # the OpenAI request cached this prompt
    with server.anthropic.messages.stream(**kw) as stream:
        seen = list(stream)
        final = stream.get_final_message()
    events = [e.type for e in seen]
    assert final.content[0].text == want
    assert events[0] == "message_start" and events[-2:] == ["message_delta", "message_stop"]
    start, end = seen[0].message.usage, final.usage  # message_start splits the prompt as the end does
    assert start.cache_read_input_tokens == end.cache_read_input_tokens > 0
    assert start.input_tokens == end.input_tokens == m.usage.input_tokens and start.output_tokens == 0
    assert "content_block_start" in events and "content_block_stop" in events
    assert server.anthropic.messages.count_tokens(model="smollm2", messages=messages).input_tokens > 5


def test_a_prompt_longer_than_the_context_is_refused_before_any_model_work(server):
    words = "hello " * 9000  # SmolLM2 holds 8192 positions
    status, error = post(server.port, "/v1/chat/completions",
                         {"messages": [{"role": "user", "content": words}]})
    assert status == 400 and "8192" in error["error"]["message"]
    status, error = post(server.port, "/v1/messages", {"max_tokens": 4, "messages": [
        {"role": "user", "content": words}]})
    assert status == 400 and error["error"]["type"] == "invalid_request_error"
