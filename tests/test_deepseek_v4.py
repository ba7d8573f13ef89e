"""DeepSeek-V4-Flash(-0731) as a target (mlx-vlm's `deepseek_v4`, the `deepseek-v4` extra) and
its in-checkpoint DSpark stages drafting for it.

The checkpoint is `deepseek_v4_synth`'s: DeepSeek's names, FP8 e4m3 weights with 128x128
ue8m0 tiles, FP4 experts, a hash-routed first layer, a ratio-4 (sparse, indexed) and a
ratio-128 pooled layer, a window of 8, and the 0731 DSpark stages `mtp.{0,1,2}.*` (FP8/FP4
too). mlx-vlm is a test dependency (the `test` extra installs it): these tests run in CI.
"""

import argparse
import json
import sys
from collections import Counter

import mlx.core as mx
import numpy as np
import pytest

import deepseek_v4_synth as S
import dspark_v4_ref as R
import mlx_spec
import tiny
from mlx_spec.drafters.dspark_v4 import V4DSparkDrafter
from mlx_spec.taps import Taps
from mlx_spec.targets.deepseek_v4 import DeepseekV4
from runs import spec_run, target_arrays

IDS, BLOCK, NOISE = [1, 2, 3], 5, 95
CONFIG = {**S.CONFIG, "dspark_block_size": BLOCK, "dspark_target_layer_ids": IDS,
          "dspark_noise_token_id": NOISE}
PROMPT = [5, 6, 7, 8, 9, 5, 6, 7, 10, 11, 12]
N = 140  # 11 + 140 positions: the ratio-128 layer pools a group, the ratio-4 layer indexes 37


def greedy(model, prompt, n, *more) -> list[int]:
    """Plain greedy decoding, one token per forward: what speculative output must equal.

    `more`: further prompt chunks fed as their own forwards after `prompt` (mlx-vlm's
    prompt path pools the ratio-4 layer by chunk, so a reference must chunk as the run did)."""
    cache, out = model.make_cache(), []
    logits = model(mx.array([prompt]), cache=cache)[0, -1]
    for chunk in more:
        logits = model(mx.array([chunk]), cache=cache)[0, -1]
    for _ in range(n):
        out.append(int(mx.argmax(logits)))
        logits = model(mx.array([[out[-1]]]), cache=cache)[0, -1]
    return out


@pytest.fixture(scope="module")
def v4(tmp_path_factory):
    """(folder, model, stage tensors, float model, reference output): the trunk with 0731
    stages whose Markov head encodes the target's greedy bigram (a "trained" drafter)."""
    folder = tmp_path_factory.mktemp("v4")
    lm = S.language_model(CONFIG, seed=1)
    stored, plain = S.pack(S.native(lm))
    S.write(folder, CONFIG, stored)
    model, _ = mlx_spec.load(str(folder))
    seq = PROMPT + greedy(model, PROMPT, N)
    f = np.arange(tiny.VOCAB)
    for a in set(seq):
        nxt = Counter(b for x, b in zip(seq, seq[1:]) if x == a)
        f[a] = nxt.most_common(1)[0][0] if nxt else f[a]
    V = tiny.VOCAB
    w = R.stage_tensors(np.random.default_rng(0), CONFIG, "0731", len(IDS), V)
    w["mtp.2.markov_head.markov_w1.weight"] = np.eye(V, dtype=np.float32) * 10
    w["mtp.2.markov_head.markov_w2.weight"] = np.zeros((V, V), np.float32)
    w["mtp.2.markov_head.markov_w2.weight"][f, np.arange(V)] = 10
    stages, stages_plain = R.packed(w, tile=128)
    S.write(folder, {**CONFIG, "dspark_markov_rank": V}, {**stored, **stages})
    model, _ = mlx_spec.load(str(folder))
    return folder, model, stages_plain, plain, seq[len(PROMPT):]


def test_the_published_layout_loads_quantized_as_stored(v4):
    folder, model, _, plain, _ = v4
    assert isinstance(model, DeepseekV4) and model.model_type == "deepseek_v4"
    layer = model.layers[1]  # ratio-4 layer: window, compressor, indexer
    assert (layer.attn.wq_a.mode, layer.attn.wo_a.mode, layer.attn.indexer.wq_b.mode,
            layer.ffn.shared_experts.gate_proj.mode) == ("mxfp8",) * 4
    assert layer.ffn.switch_mlp.up_proj.mode == "mxfp4"
    assert not hasattr(layer.attn.compressor.wkv, "mode")  # stored unquantized: kept so
    floats = {k: mx.array(np.asarray(v, np.float32)) for k, v in plain.items()}
    S.write(folder.parent / "float", CONFIG, floats)  # the numbers the FP8/FP4 bytes encode
    ref, _ = mlx_spec.load(str(folder.parent / "float"))
    x = mx.array([[int(t) for t in np.random.default_rng(3).integers(0, 96, 40)]])
    np.testing.assert_allclose(np.array(model(x)), np.array(ref(x)), atol=2e-3, rtol=2e-3)


def test_verify_blocks_give_the_logits_of_one_token_decoding(v4):
    """Blocks of up to 17 tokens (a verify forward) equal one-token decoding. mlx-vlm's own
    forward takes its prompt path past 8 tokens, which pools the ratio-4 layer differently:
    without the split into pieces of 8 the logits move."""
    _, model, _, _, out = v4
    seq = PROMPT + out
    cache = model.make_cache()
    model(mx.array([seq[:40]]), cache=cache)
    one = [np.array(model(mx.array([[t]]), cache=cache)[0, 0]) for t in seq[40:57]]
    for L in (3, 8, 9, 17):
        cache = model.make_cache()
        model(mx.array([seq[:40]]), cache=cache)
        got = np.array(model(mx.array([seq[40:40 + L]]), cache=cache)[0])
        np.testing.assert_allclose(got, np.stack(one[:L]), atol=1e-4, rtol=1e-4, err_msg=f"L={L}")
    cache = model.make_cache()
    model(mx.array([seq[:40]]), cache=cache)
    whole = np.array(model.lm_head(model.model(mx.array([seq[40:57]]), cache=cache))[0])
    assert np.abs(whole - np.stack(one)).max() > 1e-2


def tap_means(model, seq, taps):
    with Taps(model, taps) as t:
        model(mx.array([seq]))
        got = t.read()
    return np.concatenate([np.array(got[i], np.float64).mean(1) for i in taps], -1), got


def test_stages_read_the_v4_trunk_and_match_numpy(v4):
    folder, model, w, _, out = v4
    d = mlx_spec.load_drafter(folder, model)  # found through TARGET_PROBES, no kind given
    assert isinstance(d, V4DSparkDrafter) and d.taps == tuple(IDS) and d.net.variant == "0731"
    assert d.net.layers[0].self_attn.q_a_proj.mode == "mxfp8"  # stages stored FP8: kept so
    d.bind(model, None)
    seq = PROMPT + out[:20]
    cat, taps = tap_means(model, seq, d.taps)
    assert taps[1].shape == (len(seq), CONFIG["hc_mult"], CONFIG["hidden_size"])  # hc streams
    d.prefill(seq[:12], {i: v[:12] for i, v in taps.items()})  # past the 8-row window
    E, head = target_arrays(model)
    ref = R.Reference(w, CONFIG, IDS, BLOCK, NOISE)
    for done, step in ((12, 4), (16, 1)):
        U, h = d.step_logits(seq[done], BLOCK)
        h_ref, normed = ref.block(cat[:done], seq[done], E)
        np.testing.assert_allclose(np.array(h), h_ref, atol=1e-3, rtol=1e-3)
        np.testing.assert_allclose(np.array(U), normed @ head.T, atol=1e-3, rtol=1e-3)
        d.commit(seq[done:done + step], {i: v[done:done + step] for i, v in taps.items()})


@pytest.mark.parametrize("n", [None, 7, 12])
def test_greedy_dspark_on_the_v4_target_is_its_own_output(v4, n):
    """Past the pooled groups, with verify blocks of 6, 8 (the model card's
    num_speculative_tokens 7) and 13 tokens: rejections roll the pooled caches back."""
    folder, model, _, _, out = v4
    d = mlx_spec.load_drafter(folder, model, kind="dspark", num_speculative_tokens=n)
    assert d.max_draft == (n or BLOCK) and d.block_inputs(3).shape == (n or BLOCK,)
    got, stats = spec_run(model, d, PROMPT, N, n or BLOCK)
    assert got == out
    rejected = sum(t.accepted < len(t.proposed) for t in stats.trace)
    print(f"V4 DSpark n={n}: tau {stats.tau:.2f}, {rejected} of {len(stats.trace)} steps rejected")
    assert stats.tau > 1.3 and rejected > 5


def test_cli_num_draft_tokens_beyond_the_block_builds_longer_blocks(v4):
    from mlx_spec import generate_cli

    folder, model, _, _, _ = v4
    args = argparse.Namespace(draft="dspark", draft_model=None, num_draft_tokens=7)
    d = generate_cli.make_drafter(args, model, str(folder))
    assert isinstance(d, V4DSparkDrafter) and d.max_draft == 7
    args.num_draft_tokens = 3  # within the trained block: the block keeps its 5 rows
    assert generate_cli.make_drafter(args, model, str(folder)).max_draft == BLOCK


def test_a_conversation_continues_from_the_prompt_cache(v4):
    folder, model, _, _, _ = v4
    d = mlx_spec.load_drafter(folder, model, kind="dspark")
    turn2 = [9, 5, 6, 7, 8]
    cache = mlx_spec.make_cache(model)
    first = [r.token for r in mlx_spec.stream_generate(model, tiny.tokenizer(), PROMPT, d,
                                                       max_tokens=20, num_draft_tokens=5,
                                                       prompt_cache=cache)]
    second = [r.token for r in mlx_spec.stream_generate(model, tiny.tokenizer(), turn2, d,
                                                        max_tokens=20, num_draft_tokens=5,
                                                        prompt_cache=cache)]
    # the cache fed: PROMPT[:-1] as one chunk, then one token (or block of <= 8) at a time
    steps = [[t] for t in PROMPT[-1:] + first + turn2]
    assert second == greedy(model, PROMPT[:-1], 20, *steps)


def test_missing_extra_says_what_to_install(v4, monkeypatch):
    folder = v4[0]
    for name in [m for m in sys.modules if m == "mlx_vlm" or m.startswith("mlx_vlm.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "mlx_vlm", None)  # import mlx_vlm -> ImportError
    with pytest.raises(ImportError, match=r"pip install -e '\.\[deepseek-v4\]'"):
        mlx_spec.load(str(folder))


BAD = {
    "missing": (lambda t: t.pop("layers.2.attn.compressor.ape"), r"compressor\.ape is missing"),
    "unexpected": (lambda t: t.update({"layers.1.attn.extra.weight": np.ones((2, 2), np.float32)}),
                   r"unexpected DeepSeek-V4 tensor .*attn\.extra"),
    "fp8 grid": (lambda t: t.update({"layers.0.attn.wq_a.scale": np.full((3, 5), 127, np.uint8)}),
                 r"wq_a\.scale: a scale grid \(3, 5\).*fits no square tile"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_checkpoints_are_refused_by_name(tmp_path, case):
    tensors, _ = S.pack(S.native(S.language_model(CONFIG, seed=2)))
    edit, match = BAD[case]
    edit(tensors)
    S.write(tmp_path, CONFIG, tensors)
    with pytest.raises(ValueError, match=match):
        mlx_spec.load(str(tmp_path))



def decoded_marginals(model, sampling, prompt, positions=3, vocab=8):
    """Exact P(token at position j) with every prefix decoded as the loop feeds it (the prompt
    but its last token as one chunk, then one token at a time)."""
    out, prefixes = [], {(): 1.0}
    for _ in range(positions):
        marginal, nxt = np.zeros(vocab), {}
        for s, p_s in prefixes.items():
            cache = model.make_cache()
            model(mx.array([prompt[:-1]]), cache=cache)
            for t in [prompt[-1], *s]:
                logits = model(mx.array([[t]]), cache=cache)[0, -1]
            row = np.array(sampling.probs(logits))
            marginal += p_s * row
            nxt.update({s + (int(t),): p_s * row[t] for t in np.nonzero(row)[0]})
        out.append(marginal)
        prefixes = nxt
    return out


@pytest.mark.slow
def test_sampled_output_follows_the_target_distribution(tmp_path, monkeypatch):
    """Rejection sampling through the whole loop on the V4 target (pooled caches rolled back
    by snapshot and replay): the first 3 tokens' marginals are the target's (chi-square).
    The same check rejects a rule that keeps every draft, so it can see a broken
    acceptance; its power against subtler rules is shown in test_lossless_sampling."""
    import mlx_spec.acceptance as acceptance
    from stats_utils import chi2_pvalue

    from mlx_spec.sampling import Sampling

    def keep_all(logits, draft, q, sampling, length=None):  # wrong: never looks at p
        n = mx.array(draft.shape[0])
        return n, mx.random.categorical(mx.log(sampling.probs(logits)[n]))

    V8 = 8
    config = {**CONFIG, "vocab_size": V8, "sliding_window": 4, "compress_ratios": [0, 4, 4, 0],
              "dspark_block_size": 3, "dspark_noise_token_id": V8 - 1, "dspark_markov_rank": 4}
    trunk, _ = S.pack(S.native(S.language_model(config, seed=3, sharpen=2.0)))
    stages = R.stage_tensors(np.random.default_rng(4), config, "0731", len(IDS), 4)
    S.write(tmp_path, config, {**trunk, **stages})
    model, _ = mlx_spec.load(str(tmp_path))
    d = mlx_spec.load_drafter(tmp_path, model, kind="dspark")
    prompt = [1, 2, 3, 4, 5]  # the ratio-4 layers pool a group during the sampled tokens
    exact = decoded_marginals(model, Sampling(temp=1.0), prompt)

    def counts(runs):
        got, tok, drafted, accepted = np.zeros((3, V8)), tiny.tokenizer(vocab=V8), 0, 0
        for seed in range(runs):
            outs = list(mlx_spec.stream_generate(model, tok, prompt, d, max_tokens=3,
                                                 num_draft_tokens=3, seed=seed, temp=1.0))
            for j, r in enumerate(outs):
                got[j, r.token] += 1
            drafted, accepted = drafted + outs[-1].stats.drafted, accepted + outs[-1].stats.accepted
        return got, accepted / drafted

    right, rate = counts(200)
    print(f"V4 target, sampled: acceptance {rate:.2f}")
    assert 0.1 < rate < 0.9
    assert min(chi2_pvalue(right[j], exact[j]) for j in range(3)) > 1e-4
    monkeypatch.setattr(acceptance, "accept", keep_all)
    wrong, _ = counts(100)
    assert min(chi2_pvalue(wrong[j], exact[j]) for j in range(1, 3)) < 1e-4


def test_stages_of_another_checkpoint_are_refused_before_they_are_read(v4, tmp_path):
    folder, model, _, _, _ = v4
    config = json.loads((folder / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "hidden_size": 128}))
    mx.save_safetensors(str(tmp_path / "model.safetensors"), {"mtp.0.main_norm.weight": mx.zeros((128,))})
    with pytest.raises(ValueError, match="not the loaded target's checkpoint .hidden_size: 128 there, 64"):
        mlx_spec.load_drafter(tmp_path, model, kind="dspark")


class _Group:  # the rank and size a split reads (no messages are sent by these checks)
    def __init__(self, size, rank=0):
        self.size, self.rank = (lambda: size), (lambda: rank)


def test_splits_that_mlx_vlm_cannot_make_are_refused_by_name(tmp_path):
    from mlx_spec import distributed

    S.write(tmp_path, CONFIG, S.pack(S.native(S.language_model(CONFIG, seed=2)))[0])
    model, _ = mlx_spec.load(str(tmp_path))
    with pytest.raises(ValueError, match="4 attention heads in 2 output groups cannot be split over 3"):
        distributed.shard_model(model, "tensor", _Group(3))
    # expert widths of 32 in 32-value FP8/FP4 groups: two ranks would split a group
    with pytest.raises(ValueError, match="shared_experts.down_proj reads 32 values per row in "
                       "quantization groups of 32"):
        distributed.shard_model(model, "tensor", _Group(2))


def test_an_uneven_pipeline_split_keeps_every_layer():
    """5 layers over 2 ranks: rank 0 runs the last 3, rank 1 the first 2 (mlx-vlm 0.7.10's
    own pipeline() gives rank 0 layers 3..4 and rank 1 layers 0..1: layer 2 runs nowhere)."""
    from mlx_vlm.models.deepseek_v4 import config as C
    from mlx_vlm.models.deepseek_v4 import language as L

    config = {**CONFIG, "num_hidden_layers": 5, "compress_ratios": [0, 4, 128, 0, 4]}
    spans, caches = [], []
    for rank in (0, 1):
        model = DeepseekV4(L.LanguageModel(C.ModelConfig.from_dict(config)))
        model.pipeline(_Group(2, rank))
        inner = model.model
        spans.append((inner.start_idx, inner.end_idx))
        assert [layer is None for layer in inner.layers] == [i < spans[-1][0] for i in range(spans[-1][1])]
        caches.append(len(model.make_cache()))
    assert spans == [(2, 5), (0, 2)] and caches == [3, 2]
