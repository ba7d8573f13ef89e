"""Blocks run at a cheaper wider width: where the cost curve says a forward over m tokens costs
less than one over n < m, a lone row's chain of n tokens is verified in a block of m (filler
rows never read), and the output stays the target's own."""

import pytest

import mlx_spec
import tiny
from lossless import assert_caught, assert_lossless, exact_joint, sampled_runs, use_rule, v8_successor_llama, wrong_rule
from mlx_spec import adaptive, learned, verify
from mlx_spec.adaptive import CostModel
from runs import mlx_lm_greedy as reference


def test_each_block_runs_at_the_cheapest_width_that_saves_a_tenth():
    # Qwen2.5-Coder-1.5B float32 with OpenBLAS on this project's CPU (seconds, fastest of 3 passes)
    measured = [0.478, 0.634, 0.825, 0.907, 0.938, 0.988, 0.966, 0.983, 1.138, 1.221, 1.38, 1.495,
                1.396, 1.209, 0.974, 0.766, 0.943]
    costs = CostModel.padded(measured, 0.2)
    assert costs.widths == [1, 2, 3] + [16] * 13 + [17]  # 3 -> 16 would save only 7%
    assert CostModel.padded([1.0, 2.0, 0.5]).widths == [1, 3, 3]  # a plain step stays plain
    assert costs.verify == [0.478, 0.634, 0.825] + [0.766] * 13 + [0.943]
    assert costs.draft_per_token == 0.2
    rising = [1.0 + 0.1 * n for n in range(17)]
    assert CostModel.padded(rising).widths == list(range(1, 18))  # nothing cheaper: as they are


def cheap_widest(monkeypatch, n_max=17):
    """A pinned curve on which the widest block (17 tokens) is the cheapest but for one token."""
    curve = [1e-3 * (1 + 0.13 * n) for n in range(n_max)]
    curve[-1] = 0.8e-3
    monkeypatch.setattr(learned, "verify_seconds",
                        lambda model, n_max=17, recalibrate=False: curve[:n_max], raising=False)


def widths_run(monkeypatch) -> list[tuple[int, int]]:
    """(block, width) of every chain step verified from now on."""
    seen, real = [], verify.padded_width

    def spy(rows, drafts, cache):
        seen.append((1 + max(d.size for d in drafts), real(rows, drafts, cache)))
        return seen[-1][1]

    monkeypatch.setattr(verify, "padded_width", spy)
    return seen


@pytest.mark.parametrize("make", [lambda m: mlx_spec.DraftModelDrafter(tiny.llama_model(seed=9)),  # short chains
                                  lambda m: mlx_spec.DraftModelDrafter(m)])  # chains that end where unsure
def test_greedy_output_through_padded_blocks_is_the_targets_own(make, monkeypatch):
    cheap_widest(monkeypatch)
    seen = widths_run(monkeypatch)
    model = tiny.llama_model(seed=2)
    prompt = [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6]
    out = list(mlx_spec.stream_generate(model, tiny.tokenizer(), prompt, make(model), max_tokens=60))
    assert [r.token for r in out] == reference(model, prompt, 60)
    padded = [(n, w) for n, w in seen if w > n]
    assert len(padded) >= 3 and all(w == 17 for _, w in padded), seen
    assert out[-1].stats.tau > 1.0  # drafts were kept through padded blocks


@pytest.mark.parametrize("make", [tiny.qwen3_5_model, tiny.gemma3_model])
def test_recurrent_and_window_targets_run_blocks_at_their_own_width(make, monkeypatch):
    """A filler row would advance a recurrent state (a rejection to replay every step) or push
    a window's oldest rows out; their blocks run as they are, and stay lossless."""
    cheap_widest(monkeypatch)
    seen = widths_run(monkeypatch)
    model = make()
    prompt = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7, 8]
    out = list(mlx_spec.stream_generate(model, tiny.tokenizer(), prompt, mlx_spec.NGramDrafter(min_n=1),
                                        max_tokens=30))
    assert [r.token for r in out] == reference(model, prompt, 30)
    assert any(n > 1 for n, _ in seen) and all(w == n for n, w in seen), seen


def padded_runs(monkeypatch, runs, seed0=0):
    """Seeded prompt-lookup runs with `auto` on the successor target (as tests/test_adaptive.py's
    law test), every chain padded to 17 tokens."""
    monkeypatch.setattr(adaptive, "PRIOR", 0.6)
    cheap_widest(monkeypatch)
    seen = widths_run(monkeypatch)
    model = v8_successor_llama()
    sampling = dict(temp=0.9, min_p=0.1)
    prompt = [0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3]
    joint = exact_joint(model, prompt, 5, sampling, vocab=8)
    out = sampled_runs(model, prompt, lambda: mlx_spec.NGramDrafter(min_n=1, max_n=2), runs,
                       max_tokens=5, k="auto", vocab=8, seed0=seed0, **sampling)
    assert sum(w == 17 and n > 1 for n, w in seen) > runs, seen[:20]  # most steps padded
    return out, joint


@pytest.mark.slow
def test_sampled_law_through_padded_blocks_is_the_targets(monkeypatch):
    assert_lossless(*padded_runs(monkeypatch, 1000))


@pytest.mark.slow
def test_the_check_catches_a_wrong_rule_through_padded_blocks(monkeypatch):
    """Wrong on purpose: a rejected point-mass draft is redrawn from p, not p without it."""
    use_rule(monkeypatch, wrong_rule(residual="p"))
    assert_caught(*padded_runs(monkeypatch, 300, seed0=10_000))


def test_a_batch_is_priced_at_the_width_it_runs_at():
    """A batch's verify is never padded: two rows of 3 tokens cost a forward over 6, not the
    cheaper 16 a lone row's block of 6 would run at."""
    from mlx_spec.batch_policy import _seconds

    measured = [1.0 + 0.1 * n for n in range(17)]
    measured[15] = 0.5  # 16 tokens: the cheapest width but for one
    costs = CostModel.padded(measured)
    alone, other = adaptive.AdaptiveK(costs, 16), adaptive.AdaptiveK(costs, 16)
    assert _seconds(None, [alone], [5], None, drafting=False) == 0.5  # runs 16 wide
    assert _seconds(None, [alone, other], [2, 2], None, drafting=False) == measured[5]
