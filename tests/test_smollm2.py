"""Real weights: SmolLM2-135M-Instruct (float32) from the zoo.

Greedy speculative output must be token for token mlx-lm's own greedy output,
with every drafter, on several prompts; and a draft model that is the target
itself must have every drafted token accepted.
"""

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step

import mlx_spec
from mlx_spec import DraftModelDrafter, NGramDrafter

pytestmark = pytest.mark.download

PROMPTS = [
    "What is the capital of France?",
    "Write a Python function that returns the squares of a list of numbers.",
    "Repeat this sentence exactly: the quick brown fox jumps over the lazy dog.",
]
N = 24


def chat_ids(tokenizer, text):
    return tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)


def reference(model, ids, eos):
    out = []
    for t, _ in generate_step(mx.array(ids), model, max_tokens=N):
        out.append(int(t))
        if out[-1] in eos:
            break
    return out


def truncated_copy(path, layers):
    """SmolLM2 with only its first `layers` blocks: a cheap, weaker draft (same tokenizer)."""
    model, _ = mlx_spec.load(str(path))
    model.model.layers = model.model.layers[:layers]
    return model


def test_greedy_is_lossless_on_real_weights(smollm2, smollm2_path):
    model, tok = smollm2
    drafters = {
        "ngram": NGramDrafter(),
        "self": DraftModelDrafter(model, tok),
        "truncated": DraftModelDrafter(truncated_copy(smollm2_path, 6), tok),
    }
    for text in PROMPTS:
        ids = chat_ids(tok, text)
        want = reference(model, ids, tok.eos_token_ids)
        for name, drafter in drafters.items():
            out = list(mlx_spec.stream_generate(model, tok, ids, drafter, max_tokens=N,
                                                num_draft_tokens=5))
            assert [r.token for r in out] == want, f"{name} diverged on {text!r}"
            if name == "self":
                assert out[-1].stats.acceptance_rate == 1.0


def test_answers_the_capital_question(smollm2):
    model, tok = smollm2
    text = mlx_spec.generate(model, tok, chat_ids(tok, PROMPTS[0]), NGramDrafter(), max_tokens=20)
    assert "Paris" in text
