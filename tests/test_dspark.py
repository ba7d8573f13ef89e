"""DSpark: DeepSpec conversion, Markov chain and confidences vs NumPy, the cut, losslessness."""

import argparse
import json
from collections import Counter

import mlx.core as mx
import numpy as np
import pytest

import dflash_synth as S
from converters import dspark as conv
from converters import head as head_cli
from converters.common import ConversionError
from mlx_spec.acceptance import accept as masked_accept
from mlx_spec.drafters.base import Draft
from mlx_spec.drafters.spark_chain import confidence_length
from mlx_spec.heads import load_drafter
from mlx_spec.sampling import Sampling
from lossless import (assert_caught, assert_deep, assert_lossless, exact_joint, sampled_runs,
                      use_rule, wrong_rule)
from runs import mlx_lm_greedy as greedy, replay_greedy_blocks, spec_run, target_arrays

PROMPT = [5, 6, 7, 8, 9, 5, 6, 7]
IDS = [-1, 2]  # DeepSpec output-of-layer ids; -1 = the embedding output
_state = {}


def echo_target():
    """A tiny qwen3 target plus the bigram its own greedy output follows (a 'trained' Markov head)."""
    if "t" not in _state:
        model, cfg = S.qwen3_target(seed=0)
        S.echo_target(model, shift=1, mix=3.0)
        f = np.array(mx.argmax(model(mx.arange(S.V)[:, None])[:, -1], -1))
        seq = PROMPT + greedy(model, PROMPT, 100)
        for a in set(seq):
            nxt = Counter(b for x, b in zip(seq, seq[1:]) if x == a)
            if nxt:
                f[a] = nxt.most_common(1)[0][0]
        _state["t"] = (model, cfg, f)
    return _state["t"]


def make_head(tmp, rank=S.V, trained=True, seed=0, **cfg_kw):
    """A DeepSpec DSpark checkpoint for the echo target, converted; returns (folder, weights)."""
    model, tcfg, f = echo_target()
    tdir = tmp / "target"
    if not tdir.exists():
        S.write_target(tdir, model, tcfg)
    rng = np.random.default_rng(seed)
    w = S.network_weights(rng, 2, len(IDS))
    if trained:
        w = S.copy_anchor(w, 2)
    w.update(S.spark_weights(rng, model, rank))
    if trained and rank == S.V:  # W2 W1[prev] = 100 * onehot(f(prev)): the target's own bigram
        w["markov_head.markov_w1.weight"] = np.eye(S.V, dtype=np.float32) * 10
        w2 = np.zeros((S.V, S.V), np.float32)
        w2[f, np.arange(S.V)] = 10
        w["markov_head.markov_w2.weight"] = w2
    src = S.save_checkpoint(tmp / f"src{seed}{rank}", S.dspark_config(tcfg, 2, IDS, rank=rank, **cfg_kw), w)
    return conv.convert(src, tmp / f"head{seed}{rank}", tdir), w


def reference(w, rank=S.V):
    return S.Reference(w, layers=2, windows=[None, None], causal=[False, False], block=7)


def run(model, d, n=80, k=7, **kw):
    return spec_run(model, d, PROMPT, n, k, **kw)


def mx_taps(taps, a, b):
    return {k: mx.array(v[a:b].astype(np.float32)) for k, v in taps.items()}


# ---- conversion ---------------------------------------------------------------------------


def test_round_trip_drops_copied_embeddings_and_pins_the_taps(tmp_path):
    out, w = make_head(tmp_path)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["mlx_spec"]["drafter"] == "dspark" and cfg["mlx_spec"]["taps"] == ["embed", 2]
    assert (cfg["block_size"], cfg["markov_rank"], cfg["confidence_head"]) == (7, S.V, True)
    assert cfg["confidence_with_markov"] and cfg["confidence_bias"]
    assert not cfg["own_embeddings"] and not cfg["own_lm_head"]  # byte copies of the target's
    stored = mx.load(str(out / "model.safetensors"))
    assert "embed_tokens.weight" not in stored and "lm_head.weight" not in stored
    assert np.array_equal(np.array(stored["markov_head.markov_w2.weight"]), w["markov_head.markov_w2.weight"])
    # a head whose LM head differs from the target's keeps its own
    model, tcfg, _ = echo_target()
    w2 = dict(w, **{"lm_head.weight": w["lm_head.weight"] * 1.5})
    src = S.save_checkpoint(tmp_path / "src-own", S.dspark_config(tcfg, 2, IDS, rank=S.V), w2)
    parser = argparse.ArgumentParser()
    head_cli.add_arguments(parser)
    args = parser.parse_args([str(src), str(tmp_path / "own"), "--target", str(tmp_path / "target")])
    assert head_cli.run(args) == 0  # --format auto picks dspark
    cfg = json.loads((tmp_path / "own" / "config.json").read_text())
    assert cfg["mlx_spec"]["drafter"] == "dspark" and cfg["own_lm_head"] and not cfg["own_embeddings"]


BAD = {
    "gated markov": (dict(markov_head_type="gated"), "only 'vanilla'"),
    "confidence needs markov": (dict(markov_rank=0, confidence_head_with_markov=True), "markov_rank is 0"),
    "other target depth": (dict(num_target_layers=36), "36-layer target"),
    "final layer": (dict(target_layer_ids=[-1, 3]), "last layer"),
    "no layer ids": (dict(target_layer_ids=[]), "no target_layer_ids"),
    "gemma layout": (dict(architectures=["Gemma4DSparkModel"]), "Gemma 4 DSpark head .* builds only the Qwen3"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_checkpoints_are_refused_with_the_reason(case):
    model, tcfg, _ = echo_target()
    w = S.network_weights(np.random.default_rng(0), 2, 2)
    w.update(S.spark_weights(np.random.default_rng(0), model, 16))
    over, msg = BAD[case]
    with pytest.raises(ConversionError, match=msg):
        conv.build({**S.dspark_config(tcfg, 2, IDS, rank=16), **over}, {k: mx.array(v) for k, v in w.items()}, tcfg)


def test_misshaped_markov_tensor_is_refused():
    model, tcfg, _ = echo_target()
    w = S.network_weights(np.random.default_rng(0), 2, 2)
    w.update(S.spark_weights(np.random.default_rng(0), model, 16))
    w["markov_head.markov_w2.weight"] = w["markov_head.markov_w2.weight"][:, :8]
    with pytest.raises(ConversionError, match="misshaped"):
        conv.build(S.dspark_config(tcfg, 2, IDS, rank=16), {k: mx.array(v) for k, v in w.items()}, tcfg)


def test_deepseek_v4_in_checkpoint_dspark_needs_a_deepseek_v41_target(tmp_path):
    # the stages themselves are tested in test_dspark_v4.py
    (tmp_path / "config.json").write_text(json.dumps(
        {"model_type": "deepseek_v4", "dspark_block_size": 5, "dspark_target_layer_ids": [40, 41, 42],
         "dspark_noise_token_id": 128799}))
    with pytest.raises(ValueError, match="DeepSeek-V4 DSpark stages.*deepseek_v41"):
        load_drafter(tmp_path, echo_target()[0], kind="dspark")


def test_bind_refuses_a_target_with_another_vocabulary(tmp_path):
    d = load_drafter(make_head(tmp_path, rank=16, trained=False)[0], echo_target()[0])
    other, _ = S.qwen3_target(seed=0, vocab=S.V + 4)
    with pytest.raises(ValueError, match=f"this DSpark head cannot draft for this target: drafts over {S.V} "
                       f"tokens, but the target's vocabulary has {S.V + 4}. Use a head made for this model"):
        d.bind(other, None)


# ---- the drafter against NumPy -------------------------------------------------------------


def test_markov_chain_confidences_and_q_match_numpy_across_commits(tmp_path):
    out, w = make_head(tmp_path, rank=16, trained=False)
    model, _, _ = echo_target()
    d = load_drafter(out, model)
    d.bind(model, None)
    ref, (E, head) = reference(w), target_arrays(model)
    seq = [int(t) for t in np.random.default_rng(2).integers(0, 90, 40)]
    taps = S.target_taps(model, seq, d.taps)
    cat = S.concat_taps(taps, d.taps)
    d.prefill(seq[:12], mx_taps(taps, 0, 12))
    done = 12
    for step in (4, 1, 9):
        y = seq[done]
        toks, q, conf = d._chain(*d.step_logits(y, 7), y, Sampling())
        want_t, _, want_c = ref.dspark_chain(cat[:done], y, E, head, 7)
        assert np.array(toks).tolist() == want_t and q is None
        np.testing.assert_allclose(np.array(conf), want_c, atol=1e-4, rtol=1e-4)
        # sampling: q_j = softmax(s_j / T) with s_j built on the tokens actually drawn
        toks, q, _ = d._chain(*d.step_logits(y, 7), y, Sampling(temp=0.8))
        prev, U = y, ref.hidden(cat[:done], E[[y] + [S.MASK] * 6]) @ head.T
        for j, t in enumerate(np.array(toks).tolist()):
            s = (U[j] + w["markov_head.markov_w2.weight"] @ w["markov_head.markov_w1.weight"][prev]) / 0.8
            np.testing.assert_allclose(np.array(q[j]), np.exp(s - s.max()) / np.exp(s - s.max()).sum(),
                                       atol=1e-5)
            prev = t
        d.commit(seq[done:done + step], mx_taps(taps, done, done + step))
        done += step


def test_confidence_length_is_the_leading_run_above_the_threshold():
    rng = np.random.default_rng(0)
    for _ in range(50):
        c, thr = rng.uniform(0.3, 1.0, 7), rng.uniform(0, 1)
        a = np.cumprod(c)
        want = int(np.argmin(a >= thr)) if (a < thr).any() else 7
        assert int(confidence_length(mx.array(c), thr).item()) == want


def reference_steps(model, d, ref, got, k, threshold=None):
    """Replay a greedy run with NumPy: per step (proposal, accepted, confidences)."""
    (E, head), seq = target_arrays(model), PROMPT + got
    cat = S.concat_taps(S.target_taps(model, seq, d.taps), d.taps)

    def chain(pos):
        toks, _, conf = ref.dspark_chain(cat[:pos], seq[pos], E, head, 7)
        return toks, conf

    return replay_greedy_blocks(seq, len(PROMPT), k, 7, chain, threshold)


@pytest.mark.parametrize("threshold", [None, 0.55])
def test_proposals_tau_and_the_confidence_cut_equal_the_numpy_reference(tmp_path, threshold):
    model, _, _ = echo_target()
    out, w = make_head(tmp_path)
    d = load_drafter(out, model)
    d.set_cut(threshold, "sync")
    got, stats = run(model, d, n=80)
    assert got == greedy(model, PROMPT, 80)
    steps = reference_steps(model, d, reference(w), got, 7, threshold)
    assert [t.proposed for t in stats.trace] == [s[0] for s in steps]
    assert [t.accepted for t in stats.trace] == [s[1] for s in steps]
    if threshold is not None:  # each cut keeps exactly the prefix whose running product clears it
        for _, _, a, cut in steps:
            assert (a[:cut] >= threshold).all() and (cut == 7 or a[cut] < threshold)
        assert {s[3] for s in steps} - {7}, "the cut never acted"
    tau_ref = np.mean([s[1] + 1 for s in steps])
    print(f"DSpark synthetic tau (threshold {threshold}): drafter {stats.tau:.3f}, NumPy {tau_ref:.3f}")
    assert stats.tau == pytest.approx(tau_ref) and stats.tau > 1.3


def test_masked_cut_returns_the_whole_block_and_a_lazy_length(tmp_path):
    model, _, _ = echo_target()
    out, w = make_head(tmp_path)
    d = load_drafter(out, model)
    d.set_cut(0.55, "mask")
    d.bind(model, None)
    taps = S.target_taps(model, PROMPT, d.taps)
    d.prefill(PROMPT, mx_taps(taps, 0, len(PROMPT)))
    draft = d.propose(3, 7, Sampling())
    assert isinstance(draft, Draft) and draft.length is not None and draft.size == 7
    _, _, conf = reference(w).dspark_chain(S.concat_taps(taps, d.taps), 3, *target_arrays(model), 7)
    a = np.cumprod(conf)
    assert int(draft.length.item()) == (int(np.argmin(a >= 0.55)) if (a < 0.55).any() else 7)


@pytest.mark.parametrize("variant", ["no-cut", "mask-cut", "sync-cut", "rank0-dflash-layout"])
def test_greedy_output_is_the_targets_own(tmp_path, variant):
    model, _, _ = echo_target()
    out, _ = make_head(tmp_path, rank=0 if variant.startswith("rank0") else S.V,
                       **({"confidence_head_with_markov": False} if variant.startswith("rank0") else {}))
    d = load_drafter(out, model)
    d.set_cut(*{"no-cut": (None,), "mask-cut": (0.5, "mask"), "sync-cut": (0.5, "sync"),
                "rank0-dflash-layout": (None,)}[variant])
    got, stats = run(model, d, n=80)
    assert got == greedy(model, PROMPT, 80)
    assert stats.drafted > stats.accepted


# ---- masked acceptance (the proposed core change) against NumPy ----------------------------


def np_outcomes(p, q, d, L):
    """Exact P(n, next token) of acceptance that verifies only d[:L]."""
    V, out, reach = p.shape[1], {}, 1.0
    for i in range(L):
        if q is None:
            a, res = min(1.0, p[i, d[i]]), p[i] * (np.arange(V) != d[i])
        else:
            a, res = min(1.0, p[i, d[i]] / q[i, d[i]]), np.maximum(p[i] - q[i], 0)
        res = res / res.sum() if res.sum() > 0 else p[i]
        for t in range(V):
            out[(i, t)] = reach * (1 - a) * res[t]
        reach *= a
    for t in range(V):
        out[(L, t)] = reach * p[L, t]
    return out


def test_masked_accept_greedy_matches_numpy():
    rng = np.random.default_rng(0)
    for _ in range(40):
        logits = rng.standard_normal((6, 5)).astype(np.float32)
        target = logits.argmax(1)
        d = np.where(rng.uniform(size=5) < 0.7, target[:5], rng.integers(0, 5, 5))
        L = int(rng.integers(0, 6))
        n_want = 0
        while n_want < L and d[n_want] == target[n_want]:
            n_want += 1
        n, t = masked_accept(mx.array(logits), mx.array(d.astype(np.uint32)), None, Sampling(), mx.array(L))
        assert (int(n.item()), int(t.item())) == (n_want, int(target[n_want]))


def residual_at_the_cut(logits, draft, q, sampling, length):
    """Wrong on purpose: at n = L it draws from the residual, as if d_L had been rejected."""
    p, k = sampling.probs(logits), draft.shape[0]
    rows = mx.arange(k)
    accepted = (mx.random.uniform(shape=(k,)) * q[rows, draft] < p[rows, draft]) & (rows < length)
    n = mx.cumprod(accepted).sum()
    row = mx.concatenate([mx.maximum(p[:k] - q, 0), p[k:]])[n]
    return n, mx.random.categorical(mx.log(row))


@pytest.mark.parametrize("with_q,L,rule", [(False, 2, masked_accept), (True, 2, masked_accept),
                                           (True, 4, masked_accept), (True, 2, residual_at_the_cut)],
                         ids=["point-mass", "q-cut", "q-no-cut", "wrong-rule-is-caught"])
def test_masked_accept_sampling_matches_the_exact_numpy_distribution(with_q, L, rule):
    from stats_utils import chi2_pvalue

    rng, V, k, samp = np.random.default_rng(1), 4, 4, Sampling(temp=1.0)
    logits = mx.array(rng.standard_normal((k + 1, V)).astype(np.float32) * 1.5)
    p = np.array(samp.probs(logits), np.float64)
    q = rng.dirichlet(np.ones(V), size=k) if with_q else None
    d = np.array([int(np.argmax(p[i])) for i in range(k)], np.uint32)
    exact = np_outcomes(p, q, d, L)
    cells = sorted(exact)
    counts = Counter()
    mx.random.seed(0)
    qm = None if q is None else mx.array(q.astype(np.float32))
    for _ in range(3000):
        n, t = rule(logits, mx.array(d), qm, samp, mx.array(L))
        counts[(int(n.item()), int(t.item()))] += 1
    assert all(c in exact for c in counts), "an impossible outcome (e.g. n > L)"
    pvalue = chi2_pvalue([counts[c] for c in cells], [exact[c] for c in cells])
    assert pvalue > 1e-4 if rule is masked_accept else pvalue < 1e-4


def test_masked_accept_with_drafts_from_q_is_lossless_for_the_first_token():
    from stats_utils import chi2_pvalue

    rng, V, k, samp = np.random.default_rng(2), 5, 3, Sampling(temp=1.0)
    logits = mx.array(rng.standard_normal((k + 1, V)).astype(np.float32))
    p0 = np.array(samp.probs(logits))[0]
    q = mx.array(rng.dirichlet(np.ones(V), size=k).astype(np.float32))
    counts = np.zeros(V)
    mx.random.seed(1)
    for _ in range(3000):
        d = mx.random.categorical(mx.log(q)).astype(mx.uint32)
        n, t = masked_accept(logits, d, q, samp, mx.array(1))
        counts[int(t.item()) if int(n.item()) == 0 else int(d[0].item())] += 1
    assert chi2_pvalue(counts, p0) > 1e-4


# ---- sampled output through the whole loop -------------------------------------------------

V8 = 8
SPARK_PROMPT = [1, 2, 3]


def bigram_spark(tmp_path_factory):
    """(target, head folder, exact law): a near-bigram tiny qwen3 target (its layers' residual
    writes scaled by 0.2) and a DSpark head whose Markov term is the target's own bigram
    logits, sharpened 1.6x (the network's output is faded out), so drafts are often right
    at every depth but q is not p (with q ~ p the residual would be close to p). Its
    confidence depends on the previous token only (c = 0.55 .. 0.97), so with threshold
    0.6 the cut lands anywhere in a 3-token block."""
    if "spark" not in _state:
        tmp = tmp_path_factory.mktemp("spark-sampled")
        model, tcfg = S.qwen3_target(seed=3, vocab=V8, sharpen=2.0, layers=3)
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight = layer.self_attn.o_proj.weight * 0.2
            layer.mlp.down_proj.weight = layer.mlp.down_proj.weight * 0.2
        mx.eval(model.parameters())
        tdir = S.write_target(tmp / "t", model, tcfg)
        bigram = np.array(model(mx.arange(V8)[:, None])[:, -1], np.float64)
        rng = np.random.default_rng(4)
        w = S.network_weights(rng, 1, 2)
        w["norm.weight"] = w["norm.weight"] * 0.02
        c = np.random.default_rng(0).permutation([0.97, 0.93, 0.9, 0.85, 0.8, 0.75, 0.7, 0.55])
        conf = np.zeros((1, S.H + V8), np.float32)
        conf[0, S.H:] = np.log(c / (1 - c))  # reads W1[prev] = onehot(prev)
        w.update({"markov_head.markov_w1.weight": np.eye(V8, dtype=np.float32),
                  "markov_head.markov_w2.weight": 1.6 * (bigram - bigram.mean(1, keepdims=True)).T.astype(np.float32),
                  "confidence_head.proj.weight": conf,
                  "confidence_head.proj.bias": np.zeros(1, np.float32)})
        cfg = S.dspark_config(tcfg, 1, [0, 1], block=3, mask=V8 - 1, rank=V8)
        head = conv.convert(S.save_checkpoint(tmp / "s", cfg, w), tmp / "h", tdir)
        joint = exact_joint(model, SPARK_PROMPT, 5, dict(temp=1.0), vocab=V8)
        _state["spark"] = (model, head, joint)
    return _state["spark"]


def spark_runs(tmp_path_factory, cut, runs, seed0=0):
    model, head, _ = bigram_spark(tmp_path_factory)
    d = load_drafter(head, model)
    d.set_cut(None if cut is None else 0.6, cut or "mask")
    return sampled_runs(model, SPARK_PROMPT, lambda: d, runs, max_tokens=5, k=3, vocab=V8,
                        record_drafts=True, seed0=seed0, temp=1.0)


def cut_at(runs):
    """Per verify step over all runs: (k rows drafted, cut length L, accepted n)."""
    return [(draft.size, draft.size if draft.length is None else int(draft.length.item()), t.accepted)
            for drafts, trace in zip(runs.proposals, runs.traces) for draft, t in zip(drafts, trace)]


@pytest.mark.slow
@pytest.mark.parametrize("cut", [None, "mask", "sync"])
def test_sampled_output_at_depth_follows_the_target_distribution(tmp_path_factory, cut):
    """Markov q_j given d_(j-1), drafted from q, through the loop at k = 3: marginals of
    positions 1..4 and neighbouring pairs against np_sampler's exact law. With the mask
    cut (lazy `Draft.length`) the whole block is drafted, the cut must act, and blocks
    accepted up to the cut (n = L < k: the next token from p_L) must be common."""
    runs = spark_runs(tmp_path_factory, cut, {None: 600, "mask": 1500, "sync": 600}[cut])
    assert_deep(runs, first_k=2, share=0.8, events=60)
    steps = cut_at(runs)
    if cut == "mask":  # every first step drafts the whole block; the cut then acts often
        assert all(drafts[0].size == 3 for drafts in runs.proposals)
        assert sum(L < size for size, L, _ in steps) > 0.3 * len(steps)
        assert sum(n == L < size for size, L, n in steps) >= 300
    assert_lossless(runs, bigram_spark(tmp_path_factory)[-1])


@pytest.mark.slow
def test_the_check_catches_a_residual_at_the_mask_cut(tmp_path_factory, monkeypatch):
    """Wrong on purpose: at n = L < k the next token from the residual of row L, as if
    d_L had been proposed and rejected. Only the mask cut has such steps."""
    use_rule(monkeypatch, wrong_rule(cut="residual"))
    runs = spark_runs(tmp_path_factory, "mask", 400, seed0=10_000)
    assert_caught(runs, bigram_spark(tmp_path_factory)[-1])
