"""MTP heads on tiny synthetic checkpoints in each real layout.

Layouts: DeepSeek-V3, GLM-4.5/4.6, Qwen3.5, MiMo, Qwen3-Next.

Each checkpoint is written the way Hugging Face ships it and loaded with
`mlx_lm.load`; the MTP module comes from the same safetensors through our
loader. The head's logits and greedy chains must equal an independent NumPy
implementation; decoding must stay the target's own; tau must be what the
NumPy head would give on the same target.
"""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm import load

import mlx_spec
import mtp_checkpoints as ckpts
import tiny
from runs import mlx_lm_greedy as greedy_reference
from mlx_spec.drafters.mtp import MTPDrafter, extract, load_mtp, probe
from mlx_spec.drafters.mtp.families import FAMILIES, module_prefix, tensor_index
from mlx_spec.sampling import Sampling
from mlx_spec.taps import FINAL_NORM, Taps, decoder_stack
from mtp_reference import Reference

PROMPT = [5, 6, 7, 8, 9, 5, 6, 7]
LAYOUTS = {  # case -> (family, write() options)
    "qwen3_5": ("qwen3_5", {}),
    "deepseek_v3": ("deepseek_v3", {}),
    "glm4.5": ("glm4_moe", {}),
    "glm4.6": ("glm4_moe", {"glm46": True}),  # no shared_head.head / embed_tokens in the module
    "mimo": ("mimo", {}),
    "qwen3_next": ("qwen3_next", {}),  # MoE MTP layer, per-expert keys
    "glm4.7-flash": ("glm4_moe_lite", {}),  # MLA attention in GLM's MoE
    "deepseek_v3.2": ("deepseek_v32", {}),  # DSA: the block caches [KV, indexer keys]
    "glm5": ("glm_moe_dsa", {"glm46": True}),  # GLM-5: DSA, no embed/head copies (vLLM PR #27597)
    "nemotron_h": ("nemotron_h", {}),  # Mamba target; MTP = attention block + ReLU² MoE block
}
FAST = ["qwen3_5", "glm4.5", "glm4.6", "mimo", "qwen3_next", "glm4.7-flash", "deepseek_v3.2", "glm5",
        "nemotron_h"]  # deepseek_v3 has 61 layers: fewer tokens
_loaded: dict = {}


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("mtp")


def checkpoint(root, case):
    """(folder, model, tokenizer) of the case's synthetic checkpoint, written once."""
    if case not in _loaded:
        family, opts = LAYOUTS[case]
        folder = ckpts.write(root / case, family, **opts)
        model, tok = load(str(folder))
        _loaded[case] = (folder, model, tok)
    return _loaded[case]


def last_layer_hidden(model, seq):
    """Output of the last decoder layer (before the final norm), recorded by the core's taps."""
    n = len(decoder_stack(model).layers)
    with Taps(model, [n - 1]) as taps:
        model(mx.array(seq)[None])
        return np.array(taps.read()[n - 1])


def target_hidden(model, seq):
    return np.array(decoder_stack(model)(mx.array(seq)[None])[0])  # post-final-norm




@pytest.mark.parametrize("case", list(LAYOUTS))
def test_mlx_lm_sanitize_drops_the_mtp_tensors_we_read(root, case):
    folder, model, _ = checkpoint(root, case)
    family = LAYOUTS[case][0]
    config = json.loads((folder / "config.json").read_text())
    prefix = module_prefix(family, config)
    on_disk = mx.load(str(folder / "model.safetensors"))
    mtp_keys = [k for k in on_disk if k.startswith(prefix)]
    assert mtp_keys, "the checkpoint must hold an MTP module"
    kept = model.sanitize(dict(on_disk))
    assert not [k for k in kept if "mtp" in k or k.startswith(prefix)]
    drafter = mlx_spec.load_drafter(folder, model, kind="mtp")
    assert isinstance(drafter, MTPDrafter) and drafter.config.family == family
    if case == "qwen3_5":
        assert len(mtp_keys) == 15  # as in a dense Qwen3.5/3.6-27B
    if case == "glm4.6":
        assert not drafter.config.own_head and not drafter.config.own_embed
    if case in ("deepseek_v3", "glm4.5"):
        assert drafter.config.own_head and drafter.config.own_embed


def bound_drafter(root, case):
    """(target, NumPy reference, MTP drafter bound to the target) for a layout."""
    folder, model, tok = checkpoint(root, case)
    drafter = mlx_spec.load_drafter(folder, model, kind="mtp")
    drafter.bind(model, tok)
    return model, Reference(folder, LAYOUTS[case][0]), drafter


@pytest.mark.parametrize("case", list(LAYOUTS))
def test_draft_logits_equal_numpy(root, case):
    model, ref, drafter = bound_drafter(root, case)
    seq = np.random.default_rng(3).integers(0, ckpts.V, 12).tolist()
    hidden = target_hidden(model, seq)
    got, _, _ = drafter.head(mx.array(hidden[:-1]), mx.array(seq[1:], mx.uint32), drafter.cache[0],
                             drafter._embed, drafter._lm_head)
    want, _, _ = ref.forward(hidden[:-1], seq[1:])
    np.testing.assert_allclose(np.array(got), want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


@pytest.mark.parametrize("case", list(LAYOUTS))
def test_chained_proposals_equal_numpy(root, case):
    model, ref, drafter = bound_drafter(root, case)
    seq = PROMPT + [3]
    hidden = target_hidden(model, seq)
    drafter.prefill(PROMPT, {FINAL_NORM: mx.array(hidden[: len(PROMPT)])})
    got = drafter.propose(3, 5, Sampling()).tokens.tolist()
    assert got == ref.proposals(hidden[: len(PROMPT)], seq, 5)


def numpy_tau(model, ref, prompt, k, n_tokens):
    """tau of the NumPy head on the target's own greedy continuation."""
    out = greedy_reference(model, prompt, n_tokens)
    hidden = target_hidden(model, prompt + out)
    emitted, steps, proposals = 1, [], []
    while emitted < n_tokens:
        kk = min(k, n_tokens - emitted - 1)
        ctx = prompt + out[:emitted]
        d = ref.proposals(hidden[: len(ctx) - 1], ctx, kk) if kk else []
        n = next((i for i, t in enumerate(d) if t != out[emitted + i]), len(d))
        steps.append(n + 1)
        proposals.append(d)
        emitted += n + 1
    return sum(steps) / len(steps), proposals, out


@pytest.mark.parametrize("case", list(LAYOUTS))
def test_greedy_is_lossless_and_tau_matches_numpy(root, case):
    folder, model, tok = checkpoint(root, case)
    n_tokens = 14 if case == "deepseek_v3" else 40
    ref = Reference(folder, LAYOUTS[case][0])
    tau_np, proposals, want = numpy_tau(model, ref, PROMPT, 3, n_tokens)
    drafter = mlx_spec.load_drafter(folder, model, kind="mtp")
    out = list(mlx_spec.stream_generate(model, tok, PROMPT, drafter, max_tokens=n_tokens,
                                        num_draft_tokens=3, trace=True))
    stats = out[-1].stats
    assert [r.token for r in out] == want
    assert [s.proposed for s in stats.trace] == proposals
    assert stats.tau == pytest.approx(tau_np)
    assert 0 < stats.acceptance_rate < 1  # both outcomes occur: rollback is exercised


def test_hidden_state_can_be_the_last_layer_output(root):
    folder, model, tok = checkpoint(root, "qwen3_5")
    drafter = load_mtp(folder, model, hidden_state="last_layer")
    drafter.bind(model, tok)
    assert drafter.taps == (len(decoder_stack(model).layers) - 1,)
    seq = PROMPT + [3]
    pre = last_layer_hidden(model, seq)
    drafter.prefill(PROMPT, {drafter.taps[0]: mx.array(pre[: len(PROMPT)])})
    got = drafter.propose(3, 4, Sampling()).tokens.tolist()
    assert got == Reference(folder, "qwen3_5").proposals(pre[: len(PROMPT)], seq, 4, feed="last_layer")
    want = greedy_reference(model, PROMPT, 20)
    out = mlx_spec.stream_generate(model, tok, PROMPT, load_mtp(folder, model, "last_layer"),
                                   max_tokens=20, num_draft_tokens=3)
    assert [r.token for r in out] == want


@pytest.mark.parametrize("case", FAST)
def test_sampled_drafts_carry_the_heads_probabilities(root, case):
    folder, model, tok = checkpoint(root, case)
    drafter = mlx_spec.load_drafter(folder, model, kind="mtp")
    drafter.bind(model, tok)
    hidden = target_hidden(model, PROMPT + [3])
    drafter.prefill(PROMPT, {FINAL_NORM: mx.array(hidden[: len(PROMPT)])})
    s = Sampling(temp=0.8, top_k=10)
    draft = drafter.propose(3, 3, s)
    logits, _, _ = Reference(folder, LAYOUTS[case][0]).forward(hidden[: len(PROMPT)], PROMPT[1:] + [3])
    q0 = np.array(draft.q[0])
    np.testing.assert_allclose(q0, np.array(s.probs(mx.array(logits[-1], mx.float32))), atol=1e-4)
    assert draft.q.shape == (3, ckpts.V) and (np.array(draft.q).sum(-1) == pytest.approx(1.0))
    assert all(q0[t] > 0 for t in draft.tokens.tolist()[:1])  # drawn from its own q


def test_a_checkpoint_without_mtp_weights_gets_a_clear_error(tmp_path):
    folder = ckpts.write(tmp_path / "converted", "qwen3_5", mtp=False)  # like an mlx-community copy
    model, _ = load(str(folder))
    with pytest.raises(ValueError, match=r"declares 1 MTP module.*no 'mtp\.\*' tensors.*convert head"):
        mlx_spec.load_drafter(folder, model, kind="mtp")


def test_models_without_mtp_support_are_not_claimed(tmp_path):
    model = tiny.llama_model()
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert probe(tmp_path, {"model_type": "llama"}, model) is None
    assert extract(tmp_path, {"model_type": "llama"}) is None


def test_qwen_norm_offsets_follow_mlx_lms_rule(root, tmp_path):
    folder, _, _ = checkpoint(root, "qwen3_5")
    raw = mx.load(str(folder / "model.safetensors"))
    _, w, _ = extract(folder)
    off = np.array(raw["mtp.pre_fc_norm_embedding.weight"])
    np.testing.assert_allclose(np.array(w["enorm.weight"]), 1.0 + off, atol=1e-6)
    np.testing.assert_allclose(np.array(w["block.self_attn.q_norm.weight"]),
                               1.0 + np.array(raw["mtp.layers.0.self_attn.q_norm.weight"]), atol=1e-6)
    # A folder whose conv1d weights are already in MLX layout was written shifted: no +1.
    mlx_layout = {k: (v.moveaxis(2, 1) if "conv1d.weight" in k else v) for k, v in raw.items()}
    (tmp_path / "config.json").write_text((folder / "config.json").read_text())
    mx.save_safetensors(str(tmp_path / "model.safetensors"), mlx_layout)
    _, w2, _ = extract(tmp_path)
    np.testing.assert_allclose(np.array(w2["enorm.weight"]), off, atol=1e-6)
    # Only the shard holding mtp.* downloaded: its writer ("pt" = raw HF, "mlx") decides.
    for fmt, want in (("pt", 1.0 + off), ("mlx", off)):
        part = tmp_path / fmt
        part.mkdir()
        (part / "config.json").write_text((folder / "config.json").read_text())
        mx.save_safetensors(str(part / "model-00002-of-00002.safetensors"),
                            {k: v for k, v in raw.items() if k.startswith("mtp.")}, metadata={"format": fmt})
        _, w3, _ = extract(part)
        np.testing.assert_allclose(np.array(w3["enorm.weight"]), want, atol=1e-6, err_msg=fmt)


def test_tensor_index_reads_headers_only(root):
    folder, _, _ = checkpoint(root, "mimo")
    index = tensor_index(folder)
    assert index["model.mtp_layers.0.input_proj.weight"][1] == (64, 128)


def test_family_table_covers_the_documented_layouts():
    assert FAMILIES["mimo"].embed_first is False  # hidden first
    assert all(FAMILIES[f].embed_first for f in ("deepseek_v3", "glm4_moe", "qwen3_5", "qwen3_next"))
    assert not FAMILIES["qwen3_5"].mask_first_position and FAMILIES["deepseek_v3"].mask_first_position
    assert not FAMILIES["nemotron_h"].mask_first_position  # vLLM nemotron_h_mtp.py masks nothing


def test_nemotron_pattern_is_read_and_checked():
    from mlx_spec.drafters.mtp.nemotron_h import pattern_of

    assert pattern_of({"mtp_hybrid_override_pattern": "*E"}) == "*E"
    assert pattern_of({"text_config": {"mtp_layers_block_type": ["attention", "moe"]}}) == "*E"
    with pytest.raises(ValueError, match="mtp_hybrid_override_pattern made of"):
        pattern_of({"mtp_hybrid_override_pattern": "M*"})  # a Mamba block in the module


def test_fused_qwen3_5_moe_experts_become_switch_mlp():
    from mlx_spec.drafters.mtp.families import to_head_weights

    E, I, H = 3, 4, 8
    gate_up, down = mx.random.normal((E, 2 * I, H)), mx.random.normal((E, H, I))
    raw = {"layers.0.mlp.experts.gate_up_proj": gate_up, "layers.0.mlp.experts.down_proj": down,
           "layers.0.mlp.gate.weight": mx.zeros((E, H)), "norm.weight": mx.zeros((H,))}
    w = to_head_weights("qwen3_5_moe", {}, raw, shift=True)
    np.testing.assert_array_equal(np.array(w["block.mlp.switch_mlp.gate_proj.weight"]), np.array(gate_up[:, :I]))
    np.testing.assert_array_equal(np.array(w["block.mlp.switch_mlp.up_proj.weight"]), np.array(gate_up[:, I:]))
    np.testing.assert_array_equal(np.array(w["block.mlp.switch_mlp.down_proj.weight"]), np.array(down))
    assert np.array(w["norm.weight"]).tolist() == [1.0] * H  # offsets shifted
    assert np.array(w["block.mlp.gate.weight"]).sum() == 0  # a router is not a norm: untouched


def test_unknown_tensors_in_the_mtp_module_are_refused():
    from mlx_spec.drafters.mtp.families import to_head_weights

    with pytest.raises(ValueError, match="matches no known key"):
        to_head_weights("qwen3_5", {}, {"fc.weight": mx.zeros((2, 4)), "weird.weight": mx.zeros(2)}, False)


def test_mtp_weights_of_another_model_are_refused(root):
    folder, _, _ = checkpoint(root, "qwen3_5")
    other = tiny.qwen3_5_model(layers=2)
    with pytest.raises(ValueError, match="not the loaded target's checkpoint.*num_hidden_layers"):
        mlx_spec.load_drafter(folder, other, kind="mtp")


def test_bind_refuses_a_target_of_another_width(root):
    _, model, tok = checkpoint(root, "qwen3_5")
    drafter = mlx_spec.load_drafter(checkpoint(root, "qwen3_5")[0], model, kind="mtp")
    with pytest.raises(ValueError, match=r"this MTP head cannot draft for this target: 64 wide, but the "
                       r"target's embeddings are 32 wide\. Use the MTP weights of this very model"):
        drafter.bind(tiny.llama_model(hidden=32), tok)
