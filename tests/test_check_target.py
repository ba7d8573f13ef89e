"""The one target-compatibility check every drafter's bind uses (mlx_spec.drafters.base)."""

import pytest

import tiny
from mlx_spec.drafters.base import RECONVERT, SAME_WEIGHTS, check_target
from mlx_spec.taps import EMBED, FINAL_NORM


def test_every_mismatch_is_named_in_one_error_with_the_fix():
    model = tiny.llama_model(layers=2, hidden=64)  # vocabulary 96
    with pytest.raises(ValueError) as err:
        check_target(model, "this head",
                     made_for={"model_type": "qwen3", "num_hidden_layers": 6, "vocab_size": 96},
                     hidden_size=32, vocab=100, layers=[0, EMBED, FINAL_NORM, 2, "mid"],
                     token_ids={"mask_token_id": 96, "pad_token_id": 0})
    msg = str(err.value)
    assert msg.startswith("this head cannot draft for this target: ")
    for part in ("converted for another target (num_hidden_layers: head made for 6, target has 2)",
                 "reads target layers [2, 'mid'], but the target has 2 decoder layers (0..1)",
                 "32 wide, but the target's embeddings are 64 wide",
                 "drafts over 100 tokens, but the target's vocabulary has 96",
                 "mask_token_id 96 is outside the target's vocabulary (0..95)"):
        assert part in msg
    assert msg.endswith(RECONVERT)
    # what agrees is not reported: model_type is never compared, vocab_size 96 matches
    assert "model_type" not in msg and "vocab_size:" not in msg and "pad_token_id" not in msg


def test_a_fitting_target_passes_and_the_fix_is_the_callers():
    model = tiny.llama_model(layers=2, hidden=64)
    check_target(model, "this head", made_for={"num_hidden_layers": 2, "hidden_size": 64}, hidden_size=64,
                 vocab=96, layers=[0, 1, EMBED, FINAL_NORM], token_ids={"mask_token_id": 95})
    check_target(model, "this head")  # nothing asked, nothing checked
    with pytest.raises(ValueError, match=f"vocabulary has 96. {SAME_WEIGHTS}$"):
        check_target(model, "these stages", SAME_WEIGHTS, vocab=97)
