"""`mlx-spec serve` on tiny random targets, driven over real HTTP on 127.0.0.1 by the official
`openai` and `anthropic` clients (and http.client where a connection must be cut).

Output through the server is the target's own (equal to `mlx_spec.generate`) for every kind
of drafter, streamed or not; cuts inside verified blocks are exact; log-probs are the
target's; concurrent clients get their solo output; clients that leave stop their request;
bad input gets the right status and shape; /metrics totals equal the per-request figures."""

from __future__ import annotations

import json
import threading
import time

import anthropic
import mlx.core as mx
import numpy as np
import openai
import pytest

import mlx_spec
import tiny
from server_utils import (metrics, open_stream, post, read_events, request, running_server, send_only,
                          sse_data, submitted_together, wait_for, word_tokenizer)
from test_conversations import drafter_case

MESSAGES = [{"role": "user", "content": "w5 w6 w7 w8 w9 w5 w6 w7 w21 w3"}]
N = 24


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def chat(c, stream=False, **kw):
    """(text, final extra fields, the response or chunks) of one chat completion."""
    kw = {"model": "test-model", "messages": MESSAGES, "max_tokens": N, "temperature": 0, **kw}
    if not stream:
        r = c.chat.completions.create(**kw)
        return r.choices[0].message.content or "", r.model_extra | {"usage": r.usage}, r
    chunks = list(c.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    return text, chunks[-1].model_extra | {"usage": chunks[-1].usage}, chunks


def templated(tok, messages=MESSAGES):
    return tok.apply_chat_template(messages, add_generation_prompt=True)


@pytest.mark.parametrize("kind", ["ngram", "draft-model", "dflash"])
def test_output_is_the_targets_streamed_or_not_for_every_drafter_and_cuts_inside_blocks_are_exact(
        tmp_path, kind):
    model, make = drafter_case(tmp_path, kind)
    tok = word_tokenizer()
    ids = templated(tok)
    want = mlx_spec.generate(model, tok, ids, None, max_tokens=N)
    with running_server(model, tok, make(), num_draft_tokens=4) as s:
        c = client(s)
        for draft in ("none", kind):
            plain, extra, _ = chat(c, extra_body={"draft": draft})
            streamed, last, _ = chat(c, stream=True, extra_body={"draft": draft})
            assert plain == streamed == want
            assert last["usage"].prompt_tokens_details.cached_tokens > 0  # the same prompt again
            for spec, timings in ((extra["speculative"], extra["timings"]), (last["speculative"], last["timings"])):
                assert spec["drafter"] == draft and spec["target_forwards"] >= 1
                assert (spec["accepted"] > 0) == (draft != "none")  # the drafter did run
                assert ("draft_n" in timings) == (draft != "none")
                assert timings["predicted_n"] == N

        # Where a block keeps several drafts, a cold run's token i is from the draft with more after it.
        out = list(mlx_spec.stream_generate(model, tok, ids, make(), max_tokens=N, num_draft_tokens=4))
        texts = [r.text for r in out]
        inside = [i for i in range(1, N - 1) if out[i].from_draft and texts[i].strip()
                  and "".join(texts).find(texts[i]) == len("".join(texts[:i]))]
        assert inside, "no kept draft to cut at"
        i = inside[0]
        for cut in ({"max_tokens": i + 1}, {"stop": [texts[i]]}):
            s.engine.store.clear()  # a cold start: the blocks are those of the run above
            text, extra, r = chat(c, **cut)
            want_text = "".join(texts[: i + 1]) if "max_tokens" in cut else "".join(texts[:i])
            assert text == want_text and extra["usage"].completion_tokens == i + 1
            assert r.choices[0].finish_reason == ("length" if "max_tokens" in cut else "stop")
            s.engine.store.clear()
            streamed, last, chunks = chat(c, stream=True, **cut)
            assert streamed == want_text and last["usage"].completion_tokens == i + 1
            assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == r.choices[0].finish_reason


def test_logprobs_are_the_targets_never_the_drafters(tmp_path):
    model, make = drafter_case(tmp_path, "draft-model")
    tok = word_tokenizer()
    want = list(mlx_spec.stream_generate(model, tok, templated(tok), None, max_tokens=12))
    with running_server(model, tok, make(), num_draft_tokens=4) as s:
        _, extra, r = chat(client(s), max_tokens=12, logprobs=True, top_logprobs=3)
    assert extra["speculative"]["accepted"] > 0
    entries = r.choices[0].logprobs.content
    assert [e.token for e in entries] == [tok.decode([w.token]) for w in want]
    got = np.array([e.logprob for e in entries])
    np.testing.assert_allclose(got, [float(w.logprobs[w.token]) for w in want], atol=1e-4)
    for e, w in zip(entries, want):
        assert len(e.top_logprobs) == 3 and e.top_logprobs[0].token == e.token  # greedy: the best
        lp = np.array(w.logprobs)
        np.testing.assert_allclose([t.logprob for t in e.top_logprobs], np.sort(lp)[::-1][:3], atol=1e-4)


def test_concurrent_clients_decode_together_and_each_gets_its_solo_output(ngram_server):
    s, tok = ngram_server, ngram_server.engine.tokenizer
    batched = lambda: sum(v for k, v in metrics(s.port).items()  # noqa: E731
                          if k.startswith("mlx_spec:decode_steps_total") and 'rows="1"' not in k)
    before = batched()
    prompts = ["w5 w6 w7 w8 w9", "w91 w32 w65 w75 w60", "w40 w41 w42 w43", "w89 w70 w87 w55"]
    want = [mlx_spec.generate(s.model, tok, templated(tok, [{"role": "user", "content": p}]), None,
                              max_tokens=16) for p in prompts]
    got = [None] * len(prompts)

    def ask(i):
        c = client(s)
        got[i] = chat(c, stream=i % 2 == 1, max_tokens=16,
                      messages=[{"role": "user", "content": prompts[i]}])[0]

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(prompts))]
    with submitted_together(s.engine, len(prompts)):
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    assert got == want
    assert batched() > before  # some steps verified several requests in one forward


def test_a_client_that_leaves_stops_its_request_and_the_next_is_served(ngram_server):
    s = ngram_server
    body = {"model": "test-model", "messages": MESSAGES, "max_tokens": 3000, "temperature": 0}
    before = metrics(s.port)
    conn, resp = open_stream(s.port, "/v1/chat/completions", {**body, "stream": True})
    assert resp.status == 200
    read_events(resp, 3)  # the role, then generated text: it is decoding
    conn.close()  # mid-stream
    wait_for(lambda: metrics(s.port)["mlx_spec:requests_total{status=\"cancelled\"}"]
             == before['mlx_spec:requests_total{status="cancelled"}'] + 1, what="the stream's cancel")
    after = metrics(s.port)
    assert after["mlx_spec:requests_running"] == 0
    # the tokens it had generated are counted (work done), no more than were asked for
    assert 2 <= after["mlx_spec:generation_tokens_total"] - before["mlx_spec:generation_tokens_total"] < 3000

    # Not streaming: the client is noticed leaving while it waits for the whole body.
    conn = send_only(s.port, "/v1/chat/completions", body)
    wait_for(lambda: s.engine.running == 1, what="the plain request to run")
    time.sleep(0.2)
    conn.close()
    wait_for(lambda: metrics(s.port)['mlx_spec:requests_total{status="cancelled"}']
             == before['mlx_spec:requests_total{status="cancelled"}'] + 2, what="the plain request's cancel")
    tok = s.engine.tokenizer
    assert chat(client(s))[0] == mlx_spec.generate(s.model, tok, templated(tok), None, max_tokens=N)


def test_a_full_queue_answers_429_and_a_waiting_client_that_leaves_frees_its_place(ngram_server):
    s = ngram_server
    s.engine.max_queue, s.engine.max_batch = 1, 1  # one decodes, one waits, a third is refused
    body = {"model": "test-model", "messages": MESSAGES, "max_tokens": 3000}
    try:
        running, resp = open_stream(s.port, "/v1/chat/completions", {**body, "stream": True})
        read_events(resp, 2)
        waiting = send_only(s.port, "/v1/chat/completions", body)
        wait_for(lambda: s.engine.waiting == 1, what="a waiting request")
        status, error = post(s.port, "/v1/chat/completions", body)
        assert status == 429 and error["error"]["type"] == "rate_limit_error"
        assert "all 1 places are taken (--max-batch) and 1 requests already wait (--max-queue 1)" in \
            error["error"]["message"]
        s.engine.max_queue = 0  # none may wait: the message says so (it read "0 requests are waiting")
        status, error = post(s.port, "/v1/chat/completions", body)
        assert status == 429 and "--max-queue 0 lets no request wait" in error["error"]["message"]
        s.engine.max_queue = 1
        waiting.close()
        wait_for(lambda: s.engine.waiting == 0, timeout=5, what="the waiting request to leave")
        assert s.engine.running == 1  # the first one decodes on
        running.close()
        wait_for(lambda: s.engine.running == 0, what="the running request to stop")
    finally:
        s.engine.max_queue, s.engine.max_batch = 16, 4
    assert metrics(s.port)['mlx_spec:requests_total{status="rejected"}'] >= 1


@pytest.mark.parametrize("body, param", [
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "robot", "content": "w5"}]}, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages"),
    ({"temperature": "hot"}, "temperature"),
    ({"top_p": 2}, "top_p"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"num_draft_tokens": 17}, "num_draft_tokens"),
    ({"draft": "eagle"}, "draft"),
    ({"n": 2}, "n"),
    ({"stop": [""]}, "stop"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"tool_choice": "required", "tools": [{"type": "function", "function": {"name": "f"}}]}, "tool_choice"),
    ({"tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice"),  # and no tools
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"logit_bias": {"5000": 1}}, "logit_bias"),
    ({"logit_bias": {"5": float("nan")}}, "logit_bias"),
    ({"logit_bias": {"5": True}}, "logit_bias"),
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"modalities": ["text", "audio"]}, "modalities"),
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"modalities": 5}, "modalities"),
    ({"logit_bias": {"5": 10**400}}, "logit_bias"),
    ({"temperature": float("inf")}, "temperature"),
    ({"repetition_penalty": float("inf")}, "repetition_penalty"),
])
def test_invalid_fields_get_400_naming_the_field_before_any_model_work(ngram_server, body, param):
    before = metrics(ngram_server.port)["mlx_spec:prompt_tokens_total"]
    status, error = post(ngram_server.port, "/v1/chat/completions", {"messages": MESSAGES, **body})
    assert status == 400 and error["error"]["param"] == param
    assert error["error"]["type"] == "invalid_request_error" and error["error"]["message"]
    assert metrics(ngram_server.port)["mlx_spec:prompt_tokens_total"] == before  # nothing ran


def test_other_bad_requests_get_their_status_in_each_apis_shape(ngram_server):
    port = ngram_server.port
    status, error = post(port, "/v1/chat/completions", {"model": "gpt-4o", "messages": MESSAGES})
    assert status == 404 and error["error"]["code"] == "model_not_found" and "test-model" in error["error"]["message"]
    status, _, raw = request(port, "GET", "/v1/nowhere")
    assert status == 404 and "/v1/chat/completions" in json.loads(raw)["error"]["message"]
    status, _, raw = request(port, "GET", "/v1/chat/completions")
    assert status == 405 and json.loads(raw)["error"]["type"] == "invalid_request_error"
    status, _, raw = request(port, "POST", "/v1/completions", b"{not json")
    assert status == 400 and "not valid JSON" in json.loads(raw)["error"]["message"]
    status, _, raw = request(port, "POST", "/v1/completions", b"[" * 100_000 + b"]" * 100_000)
    assert status == 400 and "too deeply" in json.loads(raw)["error"]["message"]
    status, error = post(port, "/v1/messages", {"messages": MESSAGES})  # no max_tokens
    assert status == 400 and error == {"type": "error", "error": {
        "type": "invalid_request_error", "message": "'max_tokens' is required (an integer >= 1)"}}
    for choice in ({"type": "any"}, {"type": "tool", "name": "f"}):  # forced, with no tools or some
        for tools in ([], [{"name": "f", "input_schema": {"type": "object"}}]):
            status, error = post(port, "/v1/messages", {"messages": MESSAGES, "max_tokens": 4,
                                                        "tool_choice": choice, **({"tools": tools} if tools else {})})
            assert status == 400 and "tool_choice" in error["error"]["message"], (choice, tools)
    status, error = post(port, "/v1/completions", {"prompt": "w5 w6", "echo": True})
    assert status == 400 and error["error"]["param"] == "echo"
    assert request(port, "GET", "/v1/models/test-model")[0] == 200
    assert request(port, "GET", "/v1/models/other")[0] == 404


def test_an_oversized_body_gets_413_and_a_failure_gets_500_without_a_traceback():
    model, tok = tiny.llama_model(), word_tokenizer()
    with running_server(model, tok, None, max_body_bytes=4096) as s:
        status, error = post(s.port, "/v1/chat/completions",
                             {"messages": [{"role": "user", "content": "w5 " * 2000}]})
        assert status == 413 and "4096" in error["error"]["message"]
        status, error = post(s.port, "/v1/messages", {"max_tokens": 2, "messages": [
            {"role": "user", "content": "w5 " * 2000}]})
        assert status == 413 and error["error"]["type"] == "request_too_large"

        def fail():
            raise RuntimeError("secret internal detail")

        s.engine.decoder.step = fail  # any failure inside a decode step
        for path, body in (("/v1/chat/completions", {"messages": MESSAGES}),
                           ("/v1/messages", {"messages": MESSAGES, "max_tokens": 4})):
            status, _, raw = request(s.port, "POST", path, body)
            assert status == 500 and b"secret" not in raw and b"Traceback" not in raw
            assert b"its log has the details" in raw
        status, _, raw = request(s.port, "POST", "/v1/chat/completions", {"messages": MESSAGES, "stream": True})
        assert status == 200 and b"secret" not in raw
        assert sse_data(raw)[-1]["error"]["type"] == "server_error"
        assert metrics(s.port)['mlx_spec:requests_total{status="failed"}'] == 3


def test_metrics_totals_equal_the_sums_of_the_per_request_figures():
    model, make = drafter_case(None, "ngram")
    with running_server(model, word_tokenizer(), make(), num_draft_tokens=4) as s:
        c, figures = client(s), []
        for kw in ({}, {"stream": True}, {"extra_body": {"draft": "none"}}, {"stop": ["w91"]},
                   {"extra_body": {"num_draft_tokens": "auto"}, "max_tokens": 40},
                   {"messages": [{"role": "user", "content": "w40 w41 w42 w43"}]}):
            figures.append(chat(c, **kw)[1])
        m = metrics(s.port)
    spec = [f["speculative"] for f in figures]
    assert m["mlx_spec:spec_decode_num_drafts_total"] == sum(x["drafts"] for x in spec) > 0
    assert m["mlx_spec:spec_decode_num_draft_tokens_total"] == sum(x["drafted"] for x in spec)
    assert m["mlx_spec:spec_decode_num_accepted_tokens_total"] == sum(x["accepted"] for x in spec) > 0
    width = max(len(x["accepted_at_position"]) for x in spec)
    for i in range(width):
        assert m[f'mlx_spec:spec_decode_num_accepted_tokens_per_pos_total{{position="{i}"}}'] == sum(
            x["accepted_at_position"][i] for x in spec if i < len(x["accepted_at_position"]))
    assert m["mlx_spec:generation_tokens_total"] == sum(f["usage"].completion_tokens for f in figures)
    assert m["mlx_spec:prompt_tokens_total"] == sum(f["usage"].prompt_tokens for f in figures)
    assert m["mlx_spec:prompt_tokens_cached_total"] == sum(
        f["usage"].prompt_tokens_details.cached_tokens for f in figures) > 0
    assert m['mlx_spec:requests_total{status="completed"}'] == len(figures)
    assert m["mlx_spec:requests_running"] == m["mlx_spec:requests_waiting"] == 0


def test_the_api_key_is_required_everywhere_but_health():
    model, tok = tiny.llama_model(), word_tokenizer()
    with running_server(model, tok, None, api_key="s3cret") as s:
        body = {"messages": MESSAGES, "max_tokens": 2}
        for headers in ({}, {"authorization": "Bearer wrong"}, {"x-api-key": "s3cre"}):
            status, error = post(s.port, "/v1/chat/completions", body, headers)
            assert status == 401 and error["error"]["type"] == "authentication_error"
        status, error = post(s.port, "/v1/messages", {**body, "max_tokens": 2})
        assert status == 401 and error["error"]["type"] == "authentication_error"
        assert request(s.port, "GET", "/metrics")[0] == 401
        assert request(s.port, "GET", "/health")[0] == 200
        status, _ = post(s.port, "/v1/messages", body, {"authorization": "Bearer other", "x-api-key": "s3cret"})
        assert status == 200  # either header may hold the key
        ok = openai.OpenAI(base_url=s.url + "/v1", api_key="s3cret", max_retries=0)
        assert ok.chat.completions.create(model="test-model", messages=MESSAGES, max_tokens=2).usage.completion_tokens == 2
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=s.url + "/v1", api_key="nope", max_retries=0).models.list()
        a = anthropic.Anthropic(base_url=s.url, api_key="s3cret", max_retries=0)
        assert a.messages.create(model="test-model", max_tokens=2, messages=MESSAGES).usage.output_tokens == 2


def routing_tokenizer(out: list[int]):
    """Words of the tiny model's own output renamed into think and tool-call markers, so its
    greedy text is `<think> w <\\think> <tool_call> w </tool_call>` and then EOS."""
    names = {out[0]: "<think>", out[2]: "</think>", out[3]: "<tool_call>", out[5]: "</tool_call>"}
    return word_tokenizer(eos=out[6], rename=names, tool_call_start="<tool_call>",
                          tool_call_end="</tool_call>",
                          tool_parser=lambda text, tools: {"name": tools[0]["function"]["name"],
                                                           "arguments": {"words": text.split()}})


def test_reasoning_and_tool_calls_are_routed_in_both_apis():
    model = tiny.llama_model()
    prompt = [{"role": "user", "content": "w91 w32 w65 w75 w60"}]
    out = [r.token for r in mlx_spec.stream_generate(model, word_tokenizer(), templated(word_tokenizer(), prompt),
                                                     None, max_tokens=7)]
    assert len(set(out)) == 7
    tok = routing_tokenizer(out)
    assert tok.has_thinking and tok.has_tool_calling
    raw = mlx_spec.generate(model, tok, templated(tok, prompt), None, max_tokens=20)
    reasoning = raw.split("<think>")[1].split("</think>")[0]
    words = raw.split("<tool_call>")[1].split("</tool_call>")[0].split()
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]
    with running_server(model, tok, mlx_spec.NGramDrafter(), num_draft_tokens=3) as s:
        c = client(s)
        r = c.chat.completions.create(model="test-model", messages=prompt, tools=tools, max_tokens=20)
        message = r.choices[0].message
        assert r.choices[0].finish_reason == "tool_calls" and not (message.content or "").strip()
        assert message.model_extra["reasoning"] == reasoning
        call = message.tool_calls[0]
        assert call.function.name == "lookup" and json.loads(call.function.arguments) == {"words": words}
        chunks = list(c.chat.completions.create(model="test-model", messages=prompt, tools=tools,
                                                max_tokens=20, stream=True))
        deltas = [ch.choices[0].delta for ch in chunks]
        assert "".join(d.model_extra.get("reasoning") or "" for d in deltas) == reasoning
        streamed = [t for d in deltas for t in d.tool_calls or []]
        assert [json.loads(t.function.arguments) for t in streamed] == [{"words": words}]
        assert chunks[-1].choices[0].finish_reason == "tool_calls"

        a = anthropic.Anthropic(base_url=s.url, api_key="unused", max_retries=0)
        atools = [{"name": "lookup", "input_schema": {"type": "object"}}]
        m = a.messages.create(model="test-model", max_tokens=20, messages=prompt, tools=atools, extra_body={"temperature": 0})
        kinds = [b.type for b in m.content if b.type != "text" or b.text.strip()]
        assert kinds == ["thinking", "tool_use"] and m.stop_reason == "tool_use"
        assert m.content[0].thinking == reasoning and m.content[-1].input == {"words": words}
        with a.messages.stream(model="test-model", max_tokens=20, messages=prompt, tools=atools,
                               extra_body={"temperature": 0}) as stream:
            events = [e.type for e in stream]
            final = stream.get_final_message()
        assert events[0] == "message_start" and events[-1] == "message_stop"
        assert [b.type for b in final.content] == [b.type for b in m.content]
        assert final.content[-1].input == {"words": words} and final.stop_reason == "tool_use"


@pytest.mark.parametrize("kind", ["full", "window", "recurrent"])
def test_window_and_recurrent_targets_reuse_what_their_caches_can_restore(kind):
    model = {"full": tiny.llama_model, "window": tiny.gemma3_model, "recurrent": tiny.qwen3_5_model}[kind]()
    tok = word_tokenizer()
    prompt = list(range(20, 40))  # 20 tokens: past the tiny Gemma's 8-position window
    out = [r.token for r in mlx_spec.stream_generate(model, tok, prompt, None, max_tokens=8)]
    longer, other = prompt + out + [50, 51, 52], prompt[:10] + [60, 61, 62, 63, 64]
    with running_server(model, tok, mlx_spec.NGramDrafter(min_n=1), num_draft_tokens=3) as s:
        c = client(s)
        cached = []
        for ids in (prompt, longer, other):
            r = c.completions.create(model="test-model", prompt=ids, max_tokens=8, temperature=0)
            assert r.choices[0].text == mlx_spec.generate(model, tok, ids, None, max_tokens=8)
            cached.append(r.usage.prompt_tokens_details.cached_tokens)
    assert cached[:2] == [0, len(prompt) + 8]  # a conversation that goes on: all of it
    # another branch from the 10th token: attention caches trim back to it, recurrent state cannot
    assert cached[2] == {"full": 10, "window": cached[2], "recurrent": 0}[kind] and cached[2] <= 10


@pytest.mark.parametrize("options", [dict(kv_bits=4, kv_group_size=32, quantized_kv_start=0),
                                     dict(max_kv_size=12)], ids=["kv-bits", "max-kv-size"])
def test_cache_options_apply_to_every_request_and_requests_still_decode_together(options):
    """The server's --kv-bits / --max-kv-size: each request's output is mlx-lm's own with the
    same cache settings, and concurrent requests are verified together."""
    from mlx_lm.generate import generate_step

    model = (tiny.llama_model(hidden=128, heads=4, kv_heads=2) if "kv_bits" in options
             else tiny.qwen2_model())  # head dimension 32 (groups of 32) / a window of 12
    tok = word_tokenizer()
    prompts = [[5, 6, 7, 8, 9, 5, 6, 7], [9, 9, 8, 7, 6, 5, 4, 3, 2, 1, 9, 9, 8]]
    want = [tok.decode([int(t) for t, _ in generate_step(mx.array(p), model, max_tokens=30, **options)])
            for p in prompts]
    plain = [mlx_spec.generate(model, tok, p, None, max_tokens=30) for p in prompts]
    assert want != plain  # the options change the output, so this test can fail
    got = [None, None]
    with running_server(model, tok, mlx_spec.NGramDrafter(min_n=1), num_draft_tokens=3, max_batch=2,
                        cache_options=options) as s:
        def ask(i):
            got[i] = client(s).completions.create(model="test-model", prompt=prompts[i], max_tokens=30,
                                                  temperature=0).choices[0].text

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(2)]
        with submitted_together(s.engine, 2):
            for t in threads:
                t.start()
            for t in threads:
                t.join(60)
        together = metrics(s.port).get('mlx_spec:decode_steps_total{rows="2"}', 0)
    assert got == want and together > 0


def test_bad_cache_options_stop_the_server_before_it_starts():
    from mlx_spec.server.engine import Engine

    with pytest.raises(ValueError, match="kv_bits must be one of"):
        Engine(tiny.llama_model(), word_tokenizer(), cache_options=dict(kv_bits=7))


@pytest.mark.parametrize("penalty", [{"repetition_penalty": 1.5}, {"frequency_penalty": 1.5},
                                     {"presence_penalty": 1.5}])
def test_a_prompt_cache_hit_leaves_penalties_as_they_were(ngram_server, penalty):
    """The second request reads its prompt from the cache: the penalties still see it (they saw
    only the uncached rest of it, and the output changed)."""
    from mlx_lm.generate import generate_step
    from mlx_lm.sample_utils import make_logits_processors

    tok = word_tokenizer()
    ids = templated(tok)
    want = tok.decode([int(t) for t, _ in generate_step(mx.array(ids), ngram_server.model, max_tokens=N,
                                                        logits_processors=make_logits_processors(**penalty))])
    c = client(ngram_server)
    got = [chat(c, extra_body=penalty) for _ in range(2)]
    assert [text for text, _, _ in got] == [want, want]
    assert got[1][1]["usage"].prompt_tokens_details.cached_tokens > 0


def test_a_last_assistant_message_is_continued_on_messages_and_on_request_on_chat():
    """Anthropic's prefill: the answer continues the assistant's text (it used to be closed with an
    end-of-turn and a new assistant header); on /v1/chat/completions as vLLM's
    `continue_final_message` asks. The answer is the target's continuation of that prompt."""
    chatml = ("{% for m in messages %}w90 {{ m['role'] }} {{ m['content'] }} w91 {% endfor %}"
              "{% if add_generation_prompt %}w90 assistant {% endif %}")
    tok, model = word_tokenizer(chat_template=chatml), tiny.llama_model()
    messages = [{"role": "user", "content": "w5 w6 w7"}, {"role": "assistant", "content": "w30 w31"}]
    prompt = tok.encode("w90 user w5 w6 w7 w91 w90 assistant w30 w31")
    want = tok.decode([r.token for r in mlx_spec.stream_generate(model, tok, prompt, max_tokens=6)])
    with running_server(model, tok) as s:
        status, r = post(s.port, "/v1/messages", {"model": "test-model", "max_tokens": 6, "temperature": 0,
                                                  "messages": messages})
        assert status == 200 and r["content"][0]["text"] == want
        status, r = post(s.port, "/v1/chat/completions", {"messages": messages, "max_tokens": 6,
                                                          "continue_final_message": True})
        assert status == 200 and r["choices"][0]["message"]["content"] == want
        status, r = post(s.port, "/v1/chat/completions", {"messages": messages[:1], "max_tokens": 6,
                                                          "continue_final_message": True})
        assert status == 400 and "an assistant message last" in r["error"]["message"]


def test_parallel_tool_calls_can_be_turned_off():
    """With `parallel_tool_calls: false` (Anthropic: `disable_parallel_tool_use`) an answer that
    makes several calls returns its first only (the field was ignored)."""
    from mlx_spec.server.text import Router, make_machine

    fn = {"name": "lookup", "parameters": {"type": "object"}}
    tok = word_tokenizer(rename={10: "<tool_call>", 11: "</tool_call>"}, tool_call_start="<tool_call>",
                         tool_call_end="</tool_call>",
                         tool_parser=lambda text, tools: {"name": "lookup", "arguments": {"words": text.split()}})
    text = "<tool_call> w5 </tool_call> <tool_call> w6 </tool_call> <tool_call> w7 </tool_call>"
    for single, want in ((False, [["w5"], ["w6"], ["w7"]]), (True, [["w5"]])):
        router = Router(tok, make_machine(tok), [1, 2], [{"type": "function", "function": fn}], single)
        calls = router.feed(text, "eos").tool_calls
        assert [c["arguments"]["words"] for c in calls] == want


@pytest.mark.parametrize("a_max", [8, 1], ids=["a decodes on", "a ends at its first token"])
@pytest.mark.parametrize("b_prompt", [[9, 10, 11], list(range(2, 90)) * 2], ids=["read together", "read alone"])
def test_a_client_leaving_during_its_prefill_leaves_the_requests_read_with_it_whole(b_prompt, a_max):
    """Request b's client leaves before b's prompt is read, in the step that reads a's too:
    b ends as cancelled, and a still gets its whole answer (before the fix, a read together with
    b never started and its client waited for ever; a read just before b lost its first token;
    and an `a` whose first token ended it waited for a later request to be handed it)."""
    import asyncio

    from mlx_spec.server.engine import Engine
    from mlx_spec.server.events import Finished, Job, Piece
    from runs import mlx_lm_greedy

    model, tok = tiny.llama_model(), word_tokenizer()
    engine = Engine(model, tok, None, max_batch=4)

    async def answer(job) -> tuple[list[int], str]:
        tokens = []
        while True:
            event = await asyncio.wait_for(job.next(), 60)
            if isinstance(event, Piece):
                tokens.append(event.token)
            if isinstance(event, Finished):
                return tokens, event.reason

    async def run():
        a, b = Job([5, 6, 7, 8], dict(max_tokens=a_max)), Job(b_prompt, dict(max_tokens=8))
        b.cancelled.set()  # its client is gone: the engine finds out in b's prompt progress
        engine.submit(a)
        engine.submit(b)  # both queued before the engine starts: admitted in one step
        engine.start(warm_up=False)
        return await answer(a), await answer(b)

    try:
        (a_tokens, a_reason), (b_tokens, b_reason) = asyncio.run(run())
    finally:
        engine.close()
    assert a_reason == "length" and a_tokens == mlx_lm_greedy(model, [5, 6, 7, 8], a_max)
    assert b_reason == "cancelled" and b_tokens == []


def test_top_p_zero_is_greedy_in_both_apis(ngram_server):
    """The nucleus of mass 0 is the top token alone; mlx-lm's sampler reads 0 as 'no filter',
    which would sample the whole distribution, the opposite of what the client asked."""
    c = client(ngram_server)
    greedy, _, _ = chat(c)
    sampled = {chat(c, temperature=1.0, seed=s)[0] for s in range(3)}
    assert sampled != {greedy}  # at temperature 1 this model's answers differ from greedy ones
    for s in range(3):
        assert chat(c, temperature=1.0, top_p=0, seed=s)[0] == greedy
    a = anthropic.Anthropic(base_url=ngram_server.url, api_key="unused", max_retries=0, timeout=60)
    r = a.messages.create(model="test-model", messages=MESSAGES, max_tokens=N,
                          extra_body={"temperature": 1.0, "top_p": 0})
    assert r.content[0].text == greedy


def test_a_prompt_being_built_holds_up_no_other_client(monkeypatch):
    """Building one request's prompt (chat template, tokenizing: seconds for a long one) runs
    off the event loop: /health and other requests are answered meanwhile."""
    from mlx_spec.server import openai as api

    real, started = api.parse_chat, threading.Event()

    def slow(body, engine):
        if body.raw("user") == "slow":
            started.set()
            time.sleep(3)
        return real(body, engine)

    monkeypatch.setattr(api, "parse_chat", slow)
    with running_server(tiny.llama_model(), word_tokenizer()) as s:
        got = {}
        slow_one = threading.Thread(target=lambda: got.setdefault("slow", post(
            s.port, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 2, "user": "slow"})))
        slow_one.start()
        assert started.wait(30)
        t0 = time.monotonic()
        assert request(s.port, "GET", "/health", timeout=10)[0] == 200
        waited = time.monotonic() - t0
        slow_one.join(30)
    assert got["slow"][0] == 200 and waited < 1.5, waited


def test_legacy_completion_logprobs_carry_text_offsets_streamed_or_not(ngram_server):
    """`/v1/completions` log-probs have OpenAI's legacy shape, `text_offset` included: where each
    token's text starts in the answer, running on across streamed chunks."""
    c = client(ngram_server)
    kw = dict(model="test-model", prompt="w5 w6 w7 w8 w9 w5 w6 w7", max_tokens=10, temperature=0, logprobs=2)
    whole = c.completions.create(**kw).choices[0]
    lp = whole.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 10
    starts = [whole.text.index(t, o) for t, o in zip(lp.tokens, lp.text_offset)]  # each token's text
    assert lp.text_offset[0] == 0 and all(a < b for a, b in zip(lp.text_offset, lp.text_offset[1:]))
    assert all(s - o <= 1 for s, o in zip(starts, lp.text_offset))  # where it starts (after a space)
    streamed = [ch.choices[0].logprobs for ch in c.completions.create(stream=True, **kw)
                if ch.choices and ch.choices[0].logprobs and ch.choices[0].logprobs.tokens]
    assert len(streamed) > 1
    assert [o for s in streamed for o in s.text_offset] == lp.text_offset
    assert [t for s in streamed for t in s.tokens] == lp.tokens
