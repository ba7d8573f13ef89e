"""The server's limits and endings: the queue counts only requests that wait for a place, a
shutdown answers unfinished requests with an error (never a cut-off answer marked finished),
misshaped message parts get 400, an empty answer is an empty string, long prompts are still
counted. Every server binds 127.0.0.1 and stops by itself."""

from __future__ import annotations

import json
import threading

import pytest

import mlx_spec
import tiny
from mlx_spec.server import engine as engine_mod
from server_utils import metrics, open_stream, post, request, running_server, sse_data, wait_for, word_tokenizer
from test_server_tiny import MESSAGES, client


def test_requests_that_fit_the_free_batch_places_never_count_as_waiting(ngram_server):
    """--max-queue bounds the requests waiting while others decode: with --max-queue 0 a
    request that finds a free place in the batch is served, one that would wait gets 429."""
    s = ngram_server
    s.engine.max_queue, s.engine.max_batch = 0, 2
    body = {"model": "test-model", "messages": MESSAGES, "max_tokens": 3000}
    streams = []
    try:
        for n in (1, 2):  # each finds a free place, however fast it comes
            streams.append(open_stream(s.port, "/v1/chat/completions", {**body, "stream": True}))
            assert streams[-1][1].status == 200
            wait_for(lambda: s.engine.running == n, what=f"{n} running requests")
        status, error = post(s.port, "/v1/chat/completions", body)
        assert status == 429 and "--max-queue 0" in error["error"]["message"]
    finally:
        for conn, _ in streams:
            conn.close()
        wait_for(lambda: s.engine.running == 0, what="the streams to stop")
        s.engine.max_queue, s.engine.max_batch = 16, 4


def test_a_shutdown_answers_unfinished_requests_503_never_a_finished_answer():
    """Shutting down cancels every job: a client waiting for a whole answer gets a 503 (not a
    cut-off text marked as finished), a stream ends with an error event, and a request that
    arrives meanwhile gets 503 (not 429, which clients retry at once)."""
    model, tok = tiny.llama_model(), word_tokenizer()
    body = {"model": "test-model", "messages": MESSAGES, "max_tokens": 100000, "temperature": 0}
    got = {}

    def ask(path, extra=None):
        got[(path, bool(extra))] = request(s.port, "POST", path, {**body, **(extra or {})}, timeout=60)

    with running_server(model, tok, mlx_spec.NGramDrafter(min_n=1), num_draft_tokens=3) as s:
        asks = [threading.Thread(target=ask, args=a) for a in (
            ("/v1/chat/completions",), ("/v1/messages",), ("/v1/chat/completions", {"stream": True}),
            ("/v1/messages", {"stream": True}))]
        for t in asks:
            t.start()
        wait_for(lambda: s.engine.running == 4, what="four running requests")
        s.server.should_exit = True  # what uvicorn does on Ctrl-C or SIGTERM
        for t in asks:
            t.join(60)
        with pytest.raises(engine_mod.Closing):  # (refused before the job is looked at)
            s.engine.submit(object())
    status, _, raw = got[("/v1/chat/completions", False)]
    assert status == 503 and json.loads(raw)["error"]["type"] == "server_error"
    status, _, raw = got[("/v1/messages", False)]
    assert status == 503 and json.loads(raw)["error"]["type"] == "overloaded_error"
    status, _, raw = got[("/v1/chat/completions", True)]
    assert status == 200 and "shut down" in sse_data(raw)[-1]["error"]["message"]
    status, _, raw = got[("/v1/messages", True)]
    assert status == 200 and raw.rstrip().split(b"\n")[-2] == b"event: error" and b"message_stop" not in raw


def test_an_empty_answer_is_an_empty_string_and_long_prompts_are_still_counted(ngram_server):
    s, c = ngram_server, client(ngram_server)
    first = c.chat.completions.create(model="test-model", messages=MESSAGES, max_tokens=1, temperature=0)
    word = first.choices[0].message.content.strip()
    cut = c.chat.completions.create(model="test-model", messages=MESSAGES, max_tokens=4, temperature=0, stop=[word])
    assert cut.choices[0].message.content == "" and cut.choices[0].finish_reason == "stop"  # not None
    limit, s.engine.context_length = s.engine.context_length, 4
    try:  # a prompt the context cannot hold is still counted (a client counts to know when to cut)
        status, counted = post(s.port, "/v1/messages/count_tokens", {"model": "test-model", "messages": MESSAGES})
        assert status == 200 and counted["input_tokens"] > 4
        status, error = post(s.port, "/v1/messages", {"messages": MESSAGES, "max_tokens": 2})
        assert status == 400 and "context holds 4" in error["error"]["message"]
    finally:
        s.engine.context_length = limit


@pytest.mark.parametrize("path, messages", [
    ("/v1/chat/completions", [{"role": "user", "content": [{"type": "text", "text": 5}]}]),
    ("/v1/chat/completions", MESSAGES + [{"role": "assistant", "content": "", "tool_calls": "f()"}]),
    ("/v1/chat/completions", MESSAGES + [{"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": "f()"}]}]),
    ("/v1/messages", [{"role": "user", "content": [{"type": "text", "text": ["w5"]}]}]),
])
def test_misshaped_message_parts_get_400_not_500(ngram_server, path, messages):
    before = metrics(ngram_server.port)['mlx_spec:requests_total{status="invalid"}']
    status, error = post(ngram_server.port, path, {"messages": messages, "max_tokens": 2})
    assert status == 400, error
    assert metrics(ngram_server.port)['mlx_spec:requests_total{status="invalid"}'] == before + 1


def test_a_request_that_ends_at_its_first_token_while_others_decode_ends_once(ngram_server):
    """A row that starts while another decodes gets two blocks in one step (its first token,
    then its verified block). Ended at the first (a stop string), it was ended again at the
    second, and the engine stopped for good: every later request got a 503."""
    s, c = ngram_server, client(ngram_server)
    word = c.chat.completions.create(model="test-model", messages=MESSAGES, max_tokens=1,
                                     temperature=0).choices[0].message.content.strip()
    for _ in range(3):
        conn, _ = open_stream(s.port, "/v1/chat/completions", {"messages": [{"role": "user", "content": "w40 w41 w42"}],
                                                            "max_tokens": 200, "stream": True})
        try:
            wait_for(lambda: s.engine.running == 1, what="the long request decoding")
            cut = c.chat.completions.create(model="test-model", messages=MESSAGES, max_tokens=8,
                                            temperature=0, stop=[word])
            assert cut.choices[0].message.content == "" and cut.choices[0].finish_reason == "stop"
        finally:
            conn.close()
        wait_for(lambda: s.engine.running == 0, what="the long request to stop")
    again = c.chat.completions.create(model="test-model", messages=MESSAGES, max_tokens=4, temperature=0)
    assert again.choices[0].finish_reason == "length" and s.engine.fatal is None
