"""EAGLE heads on a real target: SmolLM2-135M-Instruct (float32, from the zoo).

The heads are synthetic (random weights sized for the target: hidden 576, 30
layers, vocabulary 49152, 9 heads, 3 KV heads), converted with --target
pointing at the zoo folder. Greedy output must be the target's, token for
token; sampled output must stay inside the target's filtered support.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step

import mlx_spec
from converters.eagle import v1, v3
from eagle_fixtures import eagle1_checkpoint, eagle3_checkpoint

pytestmark = pytest.mark.download

DIMS = dict(heads=9, kv_heads=3, inter=1536)
PROMPT = "The three primary colours are"


@pytest.fixture(scope="module")
def heads(tmp_path_factory, smollm2_path):
    root = tmp_path_factory.mktemp("smollm2-heads")
    eagle1_checkpoint(root / "e1", 576, 49152, fmt="safetensors", drop=["embed_tokens.weight"], **DIMS)
    eagle3_checkpoint(root / "e3", 576, 49152, V_d=8192, fmt="bin", **DIMS)
    return {
        "eagle": v1.convert(root / "e1", root / "e1-mlx", smollm2_path),
        "eagle3": v3.convert(root / "e3", root / "e3-mlx", smollm2_path),
    }


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_greedy_equals_the_target(smollm2, heads, kind):
    model, tok = smollm2
    drafter = mlx_spec.load_drafter(heads[kind], model)
    if kind == "eagle3":  # SmolLM2 has 30 layers: inputs of layers 2, 15, 27
        assert drafter.taps == (1, 14, 26)
    ids = tok.encode(PROMPT)
    want = [int(t) for (t, _), _ in zip(generate_step(mx.array(ids), model), range(20))]
    rs = list(mlx_spec.stream_generate(model, tok, ids, drafter, max_tokens=20, num_draft_tokens=4))
    assert [r.token for r in rs] == want
    assert rs[-1].stats.drafted > 0


def test_sampled_tokens_stay_in_the_targets_top_k(smollm2, heads):
    model, tok = smollm2
    drafter = mlx_spec.load_drafter(heads["eagle3"], model)
    ids = tok.encode(PROMPT)
    out = [r.token for r in mlx_spec.stream_generate(model, tok, ids, drafter, max_tokens=20,
                                                      num_draft_tokens=3, temp=1.0, top_k=3, seed=0)]
    logits = model(mx.array(ids + out[:-1])[None])[0, len(ids) - 1:]  # the target at each emitted position
    top3 = np.argsort(-np.array(logits), axis=-1)[:, :3]
    assert all(t in row for t, row in zip(out, top3))
