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
