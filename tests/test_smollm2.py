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


def test_bf16_greedy_is_the_targets_own_up_to_rounding_ties(smollm2, smollm2_path):
    """A bf16 target: blocks of 5 verified at once against plain one-token decoding.

    In bf16 a block's matmul may round differently from a single row's, so a
    near-tie between the two best tokens could flip (see README, "What lossless
    means here"). The outputs must be identical, or first differ where plain
    decoding's top two log-probabilities are within bf16 rounding of each other.
    """
    model, tok = mlx_spec.load(str(smollm2_path))
    model.set_dtype(mx.bfloat16)
    assert model.model.layers[0].mlp.up_proj.weight.dtype == mx.bfloat16
    draft = DraftModelDrafter(smollm2[0], tok)  # the float32 weights: fast, nearly always right
    ids = chat_ids(tok, PROMPTS[1])
    plain = list(mlx_spec.stream_generate(model, tok, ids, max_tokens=24))
    spec = list(mlx_spec.stream_generate(model, tok, ids, draft, max_tokens=24, num_draft_tokens=4))
    assert spec[-1].stats.accepted >= 10  # blocks of several tokens were really verified
    got, want = [r.token for r in spec], [r.token for r in plain]
    first = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
    if first is not None:
        top2 = mx.sort(plain[first].logprobs)[-2:].tolist()
        assert top2[1] - top2[0] < 0.1, f"diverged at {first} where plain decoding was not a tie"
    else:
        assert got == want
