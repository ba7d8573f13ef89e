"""The MTP block of a DeepSeek-V4-Flash base checkpoint (`mtp.0.*`, e_proj/h_proj) on the V4 target.

Synthetic checkpoint: the `deepseek_v4_synth` trunk plus an `mtp.0` block in DeepSeek's
names (FP8 e_proj/h_proj/attention/shared experts with 128x128 tiles, FP4 experts), no
`dspark_*` fields (the base model's config). The NumPy reference is the reference
`MTPBlock` from the equations in `mlx_spec/drafters/mtp/deepseek_v4.py`, built on
`dspark_v4_ref`'s V4 block parts (mHC, attention with sinks, MoE) with a causal window.
"""

import mlx.core as mx
import numpy as np
import pytest

import deepseek_v4_synth as S
import dspark_v4_ref as R
import mlx_spec
from converters.mtp import convert
from mlx_spec.drafters.mtp import MTPDrafter
from mlx_spec.sampling import Sampling
from mlx_spec.taps import Taps
from runs import spec_run, target_arrays

PROMPT = [5, 6, 7, 8, 9, 5, 6, 7, 10, 11, 12]


def mtp_tensors(config, seed=5) -> dict:
    """`mtp.0.*`: a block shaped like a trunk layer (local attention, score routing) + the MTP parts."""
    block = S.language_model({**config, "num_hidden_layers": 1, "compress_ratios": [0],
                              "num_hash_layers": 0}, seed=seed)
    rng, H, hc = np.random.default_rng(seed), config["hidden_size"], config["hc_mult"]
    w = {"mtp.0." + k.removeprefix("layers.0."): v for k, v in S.native(block).items()
         if k.startswith("layers.0.")}
    w.update({"mtp.0.enorm.weight": 1 + 0.1 * rng.standard_normal(H), "mtp.0.hnorm.weight": 1 + 0.1 * rng.standard_normal(H),
              "mtp.0.norm.weight": 1 + 0.1 * rng.standard_normal(H),
              "mtp.0.e_proj.weight": rng.standard_normal((H, H)) / 8, "mtp.0.h_proj.weight": rng.standard_normal((H, H)) / 8,
              "mtp.0.hc_head_fn": 0.05 * rng.standard_normal((hc, hc * H)), "mtp.0.hc_head_base": 0.5 * rng.standard_normal(hc),
              "mtp.0.hc_head_scale": 1 + 0.2 * rng.standard_normal(1)})
    return {k: np.asarray(v, v.dtype if v.dtype == np.int32 else np.float32) for k, v in w.items()}


def pack_mtp(w):
    fp8 = {k: v for k, v in w.items() if k.endswith(("e_proj.weight", "h_proj.weight"))}
    stored, plain = S.pack({k: v for k, v in w.items() if k not in fp8})
    extra_stored, extra_plain = R.packed({k.replace("e_proj", "attn.wq_a.e").replace("h_proj", "attn.wq_a.h"): v
                                          for k, v in fp8.items()}, tile=128)
    back = lambda k: k.replace("attn.wq_a.e", "e_proj").replace("attn.wq_a.h", "h_proj")
    return ({**stored, **{back(k): v for k, v in extra_stored.items()}},
            {**plain, **{back(k): v for k, v in extra_plain.items()}})


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    folder = tmp_path_factory.mktemp("v4base")
    trunk, _ = S.pack(S.native(S.language_model(S.CONFIG, seed=1)))
    stored, plain = pack_mtp(mtp_tensors(S.CONFIG))
    S.write(folder, S.CONFIG, {**trunk, **stored})
    model, _ = mlx_spec.load(str(folder))
    return folder, model, plain


def reference(w, cfg, h, tokens, E, head):
    """(logits [T, V], o [T, hc, H]) of the reference MTPBlock over positions 0..T-1 (float64)."""
    ref = R.Reference.__new__(R.Reference)
    ref.w, ref.c, ref.eps = {k: np.asarray(v, np.float64) for k, v in w.items()}, cfg, cfg["rms_norm_eps"]
    ref.rule = {**R.RULES["0731"], "kv_fp8": "none"}
    p, W, T = "mtp.0.", cfg["sliding_window"], len(tokens)
    e = ref.rms(E[tokens], ref.w[p + "enorm.weight"]) @ ref.w[p + "e_proj.weight"].T
    x = e[:, None] + ref.rms(h, ref.w[p + "hnorm.weight"]) @ ref.w[p + "h_proj.weight"].T
    pre, post, comb = ref.hc(x, p, "attn")
    a_in = ref.rms((pre[..., None] * x).sum(1), ref.w[p + "attn_norm.weight"])
    pos = np.arange(T)
    kv = ref.kv(p, a_in, pos)
    a = np.concatenate([ref.attention(p, a_in[t:t + 1], kv[max(0, t - W + 1):t], pos[t:t + 1])
                        for t in range(T)])
    x = post[..., None] * a[:, None] + np.einsum("tij,tih->tjh", comb, x)
    pre, post, comb = ref.hc(x, p, "ffn")
    f = ref.moe(p, ref.rms((pre[..., None] * x).sum(1), ref.w[p + "ffn_norm.weight"]))
    o = post[..., None] * f[:, None] + np.einsum("tij,tih->tjh", comb, x)
    mix = ref.rms(o.reshape(T, -1)) @ ref.w[p + "hc_head_fn"].T
    pre = R.sigmoid(mix * ref.w[p + "hc_head_scale"] + ref.w[p + "hc_head_base"]) + cfg["hc_eps"]
    g = ref.rms((pre[..., None] * o).sum(1), ref.w[p + "norm.weight"])
    return g @ head.T, o


def test_the_base_block_drafts_with_the_reference_equations(base):
    folder, model, w = base
    d = mlx_spec.load_drafter(folder, model)  # no dspark_* fields: found as MTP
    assert isinstance(d, MTPDrafter) and d.config.family == "deepseek_v4"
    assert d.head.e_proj.mode == "mxfp8" and d.head.block.ffn.switch_mlp.up_proj.mode == "mxfp4"
    d.bind(model, None)
    n = len(model.layers)
    assert d.taps == (n - 1,)  # the streams the trunk's last layer leaves
    seq = PROMPT + [3, 4, 20, 21]
    with Taps(model, d.taps) as t:
        model(mx.array([seq]))
        h = t.read()[n - 1]
    E, head = target_arrays(model)
    d.prefill(seq[:12], {n - 1: h[:12]})
    got = d.propose(seq[12], 3, Sampling())
    # positions 0..11 pair h_t with x_{t+1}; the chain feeds the block's own streams back
    hh, toks = np.array(h[:12], np.float64), seq[1:13]
    logits, o = reference(w, S.CONFIG, hh, toks, E, head)
    chain = [int(np.argmax(logits[-1]))]
    for _ in range(2):
        hh, toks = np.concatenate([hh, o[-1:]]), toks + [chain[-1]]
        logits, o = reference(w, S.CONFIG, hh, toks, E, head)
        chain.append(int(np.argmax(logits[-1])))
    assert np.array(got.tokens).tolist() == chain
    logits, _, _ = d.head(h[:12], mx.array(seq[1:13]), d.head.make_cache(), d._embed, d._lm_head)
    want, _ = reference(w, S.CONFIG, np.array(h[:12], np.float64), seq[1:13], E, head)
    np.testing.assert_allclose(np.array(logits), want, atol=2e-3, rtol=2e-3)


def test_greedy_is_the_targets_own(base):
    folder, model, _ = base
    from test_deepseek_v4 import greedy

    d = mlx_spec.load_drafter(folder, model, kind="mtp")
    got, stats = spec_run(model, d, PROMPT, 40, 3)
    assert got == greedy(model, PROMPT, 40) and stats.drafted > 0


def test_an_extracted_head_folder_drafts_the_same(base, tmp_path):
    folder, model, _ = base
    out = convert(folder, tmp_path / "head")
    a = mlx_spec.load_drafter(out, model)
    b = mlx_spec.load_drafter(folder, model, kind="mtp")
    assert [t.proposed for t in spec_run(model, a, PROMPT, 12, 3)[1].trace] == \
           [t.proposed for t in spec_run(model, b, PROMPT, 12, 3)[1].trace]


def test_dspark_stages_are_never_read_as_mtp(tmp_path, base):
    folder, model, _ = base
    stages = R.stage_tensors(np.random.default_rng(0), S.CONFIG, "0731", 3, 16)
    trunk, _ = S.pack(S.native(S.language_model(S.CONFIG, seed=1)))
    cfg = {**S.CONFIG, "dspark_block_size": 5, "dspark_target_layer_ids": [1, 2, 3],
           "dspark_noise_token_id": 95, "dspark_markov_rank": 16}
    S.write(tmp_path, cfg, {**trunk, **stages})
    with pytest.raises(ValueError, match=r"DSpark stages under mtp\.\*, not an MTP block: use kind 'dspark'"):
        mlx_spec.load_drafter(tmp_path, model, kind="mtp")
    assert type(mlx_spec.load_drafter(tmp_path, model)).__name__ == "V4DSparkDrafter"
