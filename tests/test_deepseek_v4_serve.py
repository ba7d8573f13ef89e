"""`serve` with a DeepSeek-V4 target (mlx-vlm's model), loaded on this thread and served by
the engine's thread, with its DSpark stages drafting and without.

MLX streams belong to a thread: mlx-vlm computes its RoPE frequencies lazily when the model
is built (those of the KV compressors are first read when a pool fills), so a model
handed over unevaluated fails on the engine thread with "There is no Stream(cpu, 0) in
current thread". The model here is loaded fresh and never run on this thread before it is
served; the requests run past the ratio-4 and ratio-128 pools."""

import mlx_spec
import tiny
from server_utils import post, running_server
from test_deepseek_v4 import N, PROMPT, v4  # noqa: F401  (the checkpoint with DSpark stages)


def test_serve_v4_greedy_equals_plain_decoding(v4):  # noqa: F811
    folder, _, _, _, out = v4
    model, _ = mlx_spec.load(str(folder))  # fresh: nothing of it evaluated on this thread
    drafter = mlx_spec.load_drafter(folder, model, kind="dspark")
    want = tiny.tokenizer().decode(out)
    body = {"model": "test-model", "prompt": PROMPT, "max_tokens": N, "temperature": 0}
    with running_server(model, tiny.tokenizer(), drafter, num_draft_tokens=5) as s:
        for draft in ("dspark", "none"):
            status, got = post(s.port, "/v1/completions", {**body, "draft": draft}, timeout=120)
            assert status == 200, got
            assert got["choices"][0]["text"] == want, draft
            assert got["usage"]["completion_tokens"] == N
        assert got["speculative"]["drafter"] == "none"
    assert not s.engine._thread.is_alive()  # the server stopped by itself


def test_handover_finds_private_arrays_and_explains_the_stream_error():
    import mlx.core as mx
    import mlx.nn as nn

    from mlx_spec.handover import arrays, explain

    class Rope(nn.Module):
        def __init__(self):
            super().__init__()
            self._freqs = mx.arange(4) * 2.0  # private: not a parameter

    outer = nn.Module()
    outer.layers = [nn.Module() for _ in range(6)]  # deeper than any fixed depth limit
    inner = outer.layers[5]
    for _ in range(6):
        inner.child = nn.Module()
        inner = inner.child
    inner.rope = Rope()
    assert inner.rope.parameters() == {}
    assert any(a is inner.rope._freqs for a in arrays(outer))
    e = explain(RuntimeError("There is no Stream(cpu, 0) in current thread."))
    assert "another thread" in str(e) and "materialize" in str(e)
    assert explain(ValueError("x")).args == ("x",)
