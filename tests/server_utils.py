"""Helpers of the server tests: a real uvicorn server on 127.0.0.1 (port 0) in a thread, a
word-level tokenizer with markers, and small HTTP and Prometheus readers.

Every server binds 127.0.0.1 only, and every wait here is bounded."""

from __future__ import annotations

import http.client
import json
import re
import threading
import time
from contextlib import contextmanager
from types import SimpleNamespace

from mlx_lm.tokenizer_utils import TokenizerWrapper

# Joins messages' contents with spaces: the tiny models' "chat template".
WORDS_TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"


def word_tokenizer(vocab: int = 96, eos: int | None = None, rename: dict | None = None,
                   chat_template: str | None = WORDS_TEMPLATE, **wrapper) -> TokenizerWrapper:
    """tests/tiny.py's word-level tokenizer ("w0".."w95"), with some words renamed (e.g. to
    "<think>"), a chat template, and TokenizerWrapper options (tool-call markers, parser)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    names = {i: f"w{i}" for i in range(vocab)} | (rename or {})
    tok = Tokenizer(models.WordLevel({n: i for i, n in names.items()}, unk_token="w1"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w1",
                                 eos_token=None if eos is None else names[eos])
    hf.chat_template = chat_template
    return TokenizerWrapper(hf, **wrapper)


@contextmanager
def running_server(model, tokenizer, drafter=None, *, api_key=None, max_body_bytes=None,
                   model_id="test-model", **engine_options):
    """A started engine and uvicorn server in a thread; stopped (bounded waits) at the end."""
    from mlx_spec.server.app import Server, create_app
    from mlx_spec.server.engine import Engine

    engine = Engine(model, tokenizer, drafter, model_id=model_id, **engine_options).start()
    extra = {} if max_body_bytes is None else {"max_body_bytes": max_body_bytes}
    server = Server(create_app(engine, api_key=api_key, **extra), engine, "127.0.0.1", 0)
    thread = threading.Thread(target=server.run, name="test-uvicorn", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.01)
    try:
        yield SimpleNamespace(url=f"http://127.0.0.1:{server.port}", port=server.port,
                              engine=engine, server=server)
    finally:
        server.should_exit = True
        thread.join(20)
        engine.close(20)
        assert not thread.is_alive(), "the server did not stop"


@contextmanager
def submitted_together(engine, n: int):
    """The next `n` requests reach `engine`'s queue at once, so its next step takes them all
    however the threads sending them are scheduled (a busy machine can otherwise finish the
    first before the second arrives). Wraps this engine instance's `submit` only; requests
    held back are queued on leaving, whatever happened."""
    real, held = engine.submit, []

    def enqueue_held():
        with engine._cond:  # re-entrant: the engine's loop sees all of them or none
            while held:
                real(held.pop(0))

    def submit(job):  # called on the server's event loop: it must not block
        held.append(job)
        if len(held) == n:
            enqueue_held()

    engine.submit = submit
    try:
        yield
    finally:
        engine.submit = real
        enqueue_held()


def request(port: int, method: str, path: str, body=None, headers=None, timeout=60):
    """(status, headers, body bytes) of one plain HTTP request."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    conn.request(method, path, body=data, headers={"content-type": "application/json", **(headers or {})})
    resp = conn.getresponse()
    out = resp.status, dict(resp.getheaders()), resp.read()
    conn.close()
    return out


def post(port: int, path: str, body, headers=None, timeout=60):
    """(status, parsed JSON) of a POST."""
    status, _, data = request(port, "POST", path, body, headers, timeout)
    return status, json.loads(data)


def open_stream(port: int, path: str, body, timeout=30):
    """A connection whose streamed response is being received (read it, then close it)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    conn.request("POST", path, body=json.dumps(body).encode(), headers={"content-type": "application/json"})
    return conn, conn.getresponse()


def send_only(port: int, path: str, body, timeout=30):
    """A connection that has sent a request and reads nothing yet (close it to leave)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    conn.request("POST", path, body=json.dumps(body).encode(), headers={"content-type": "application/json"})
    return conn


def read_events(resp, n: int) -> None:
    """Read the first `n` events of a streamed response."""
    for _ in range(n):
        assert resp.readline().startswith(b"data: ") and resp.readline() == b"\n"


def sse_data(raw: bytes) -> list:
    """The `data:` payloads of a server-sent event stream (JSON decoded, [DONE] as is)."""
    out = []
    for line in raw.decode().splitlines():
        if line.startswith("data: "):
            payload = line[6:]
            out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


def metrics(port: int) -> dict:
    """/metrics as {"name{labels}": value} with the model label dropped."""
    status, _, text = request(port, "GET", "/metrics")
    assert status == 200
    out = {}
    for line in text.decode().splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            name = re.sub(r'model_name="[^"]*",?', "", name).replace("{}", "")
            out[name] = float(value)
    return out


def wait_for(predicate, timeout=20.0, what="the condition"):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)
