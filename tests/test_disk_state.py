"""What mlx-spec keeps on disk between runs (verify-cost curves, learned draft-length policies,
batch costs) is read back only when its values can be: a damaged file (NaN, infinite, zero or
negative costs, acceptances outside 0..1, negative counts, wrong types) is ignored whole, never
half-applied, never crashes a run and never spreads into the next file written. Writers in
several threads of one process never lose or tear a file."""

from __future__ import annotations

import json
import threading

import pytest

import tiny
from mlx_spec import adaptive, calibration, learned
from mlx_spec.batch_policy import TIMING_VERSION as BATCH_TIMING, BatchCosts


@pytest.mark.parametrize("times", [[-1.0] * 17, [float("nan")] * 17, [0.0] * 17, [float("inf")] * 17, []])
def test_a_curve_whose_costs_are_not_positive_seconds_is_measured_again(tmp_path, times):
    path = tmp_path / "curve.json"
    path.write_text(json.dumps({"verify_seconds": times}))
    assert calibration._read_curve(path) is None
    path.write_text(json.dumps({"verify_seconds": [0.1 * n for n in range(1, 18)]}))
    assert calibration._read_curve(path) == pytest.approx([0.1 * n for n in range(1, 18)])


def _policy() -> adaptive.AdaptiveK:
    return adaptive.AdaptiveK(adaptive.CostModel([1.0 + 0.1 * n for n in range(17)]), 4)


@pytest.mark.parametrize("damage", [
    dict(accept=[[float("nan")] * 4] * adaptive.STATES), dict(accept=[[50.0] * 4] * adaptive.STATES),
    dict(seen=[[-99] * 4] * adaptive.STATES), dict(scale="abc"), dict(scale=float("nan")),
    dict(shape=[1, 2]), dict(shape={"2": float("inf")}), dict(tree_shapes=[1]),
    dict(seen=[[float("inf")] * 4] * adaptive.STATES), dict(seen=[[3] * 4]),  # (these crashed every
    dict(seen=[[3] * 4] * (adaptive.STATES - 1) + [[3] * 2]), dict(accept=[[0.5] * 9] * adaptive.STATES),  # run)
])
def test_a_damaged_policy_file_leaves_the_policy_cold(tmp_path, damage):
    warm = _policy()
    warm.accept = [[0.9] * 4 for _ in range(adaptive.STATES)]
    warm.seen = [[3] * 4 for _ in range(adaptive.STATES)]
    warm.scale, warm.shape = 1.5, {2: 1.1}
    path = tmp_path / "policy.json"
    learned.save_learned(warm, path)
    fresh = _policy()
    assert learned._load_learned(fresh, path) and fresh.accept[0][0] == 0.9  # whole, it loads
    path.write_text(json.dumps({**json.loads(path.read_text()), **damage}))
    cold, before = _policy(), _policy()
    assert not learned._load_learned(cold, path)
    assert (cold.accept, cold.seen, cold.scale, cold.shape) == (before.accept, before.seen, before.scale, before.shape)


def test_a_mixed_drafters_policy_file_damaged_in_its_last_source_leaves_every_source_cold(tmp_path):
    from mlx_spec.sources import SourceChoice

    costs = adaptive.CostModel([1.0 + 0.1 * n for n in range(17)])
    warm = SourceChoice(costs, 4)
    for p in warm.frees:
        p.accept, p.seen = [[0.95] * 4 for _ in range(adaptive.STATES)], [[50] * 4 for _ in range(adaptive.STATES)]
    path = tmp_path / "policy.json"
    learned.save_learned(warm, path)
    whole = SourceChoice(costs, 4)
    assert learned._load_learned(whole, path) and all(p.accept[0][0] == 0.95 for p in whole.frees)
    data = json.loads(path.read_text())
    data["frees"][-1]["accept"] = [[0.5] * 3] * adaptive.STATES  # the last source's: damaged
    path.write_text(json.dumps(data))
    cold, before = SourceChoice(costs, 4), SourceChoice(costs, 4)
    assert len(cold.frees) >= 2 and not learned._load_learned(cold, path)
    assert [p.accept for p in cold.frees] == [p.accept for p in before.frees]
    assert [p.seen for p in cold.frees] == [p.seen for p in before.frees]


@pytest.mark.parametrize("text", ["[]", "null", json.dumps({"timing": BATCH_TIMING, "ratio": [[2, 3, "nan"]]})])
def test_a_damaged_batch_costs_file_is_ignored(tmp_path, text):
    path = tmp_path / "batch.json"
    path.write_text(text)
    costs = BatchCosts(path)
    costs.load()
    assert costs.ratio == {}


def test_writers_in_threads_never_lose_or_tear_a_file(tmp_path):
    path, errors = tmp_path / "x.json", []

    def write(i):
        for j in range(50):
            try:
                calibration.write_json(path, {"writer": i, "n": j, "pad": "x" * 2000})
            except OSError as e:
                errors.append(e)

    threads = [threading.Thread(target=write, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors and json.loads(path.read_text())["n"] == 49
    assert not list(tmp_path.glob("*.tmp"))


def test_a_run_starts_from_a_damaged_cache_as_from_none(tmp_path, monkeypatch):
    monkeypatch.setenv("MLX_SPEC_CACHE", str(tmp_path))
    import mlx_spec

    model = tiny.llama_model()
    prompt = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6]
    want = mlx_spec.generate(model, tiny.tokenizer(), prompt, None, max_tokens=12)
    assert mlx_spec.generate(model, tiny.tokenizer(), prompt, mlx_spec.NGramDrafter(), max_tokens=12) == want
    for f in (tmp_path / "calibration").rglob("*.json"):
        data = json.loads(f.read_text())
        f.write_text(json.dumps({k: float("nan") if k in ("scale", "verify_seconds") else v for k, v in data.items()}
                                if isinstance(data, dict) else data))
    assert mlx_spec.generate(model, tiny.tokenizer(), prompt, mlx_spec.NGramDrafter(), max_tokens=12) == want
    for f in (tmp_path / "calibration" / "policies").glob("*.json"):
        assert "NaN" not in f.read_text()


def test_policies_are_kept_apart_for_other_lookups_draft_weights_and_targets():
    """What a policy learned depends on the drafter's settings and on the weights of both models:
    n-gram sizes, branches, a corpus, and another draft model of the same shape each learn apart,
    in a file of their own and in the process (target weights included)."""
    from mlx_spec import DraftModelDrafter, NGramDrafter, Sampling

    target, greedy = tiny.llama_model(), Sampling()
    from mlx_spec import MixedDrafter
    from mlx_spec.drafters.eagle import EagleDrafter, Eagle3Head
    from mlx_spec.train.export import head_config

    def head(seed):  # two EAGLE-3 heads of one shape (a published one and its realigned copy)
        import mlx.core as mx

        cfg = head_config(tiny.llama_model(layers=6), [1, 2, 4], 32)  # (tiny models seed MLX themselves)
        mx.random.seed(seed)
        return EagleDrafter(Eagle3Head(cfg), [1, 2, 4], cfg)

    draft = DraftModelDrafter(tiny.llama_model(seed=11))
    files = {learned.policy_file(target, d, greedy).name for d in (
        NGramDrafter(), NGramDrafter(min_n=1, max_n=8), NGramDrafter(branches=3), NGramDrafter(corpus=[1, 2, 3]),
        draft, DraftModelDrafter(tiny.llama_model(seed=12)), head(1), head(2),
        MixedDrafter(NGramDrafter(), draft), MixedDrafter(NGramDrafter(branches=2), draft))}
    assert len(files) == 10, files
    assert learned.policy_file(target, NGramDrafter(), greedy) == learned.policy_file(target, NGramDrafter(), greedy)
    drafter = NGramDrafter()
    one = learned.policy_for(target, drafter, 4, sampling=greedy)
    other = learned.policy_for(tiny.llama_model(seed=3), drafter, 4, sampling=greedy)  # same shape, other weights
    assert one is not other and learned.policy_for(target, drafter, 4, sampling=greedy) is one
