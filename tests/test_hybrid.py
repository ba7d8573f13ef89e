"""Speculation on a hybrid recurrent target (Qwen3.5: GatedDeltaNet + attention layers).

The core rolls back `ArraysCache` layers with a `Checkpoint` (snapshot of the
recurrent states, drop the block from attention layers, replay the kept
tokens). Here: greedy and sampled output stay the target's with the MTP,
n-gram and draft-model drafters (a smaller Qwen3.5 as draft, itself hybrid);
after arbitrary accept/reject sequences every cache equals a fresh one fed the
committed tokens; and the replay's extra target work is counted and timed.
"""

from __future__ import annotations

import time

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mlx.utils import tree_flatten
from mlx_lm import load
from mlx_lm.generate import generate_step
from mlx_lm.models import qwen3_5
from mlx_lm.models.cache import ArraysCache

import mlx_spec
import mtp_checkpoints as ckpts
import tiny
from mlx_spec import DraftModelDrafter, NGramDrafter
from mlx_spec.cache import Checkpoint, make_cache
from mlx_spec.drafters.base import Draft
from mlx_spec import verify
from mlx_spec.request import Request
from mlx_spec.rows import Row
from mlx_spec.sampling import Sampling
from mlx_spec.taps import FINAL_NORM, decoder_stack
from lossless import assert_deep, assert_lossless, exact_joint, sampled_runs

PROMPT = [5, 6, 7, 8, 9, 5, 6, 7, 8]
_built: dict = {}


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("hybrid")


def hybrid(root, vocab=ckpts.V):
    """(folder, model, tokenizer): a Qwen3.5 checkpoint with its MTP module."""
    if vocab not in _built:
        folder = ckpts.write(root / f"qwen3_5-{vocab}", "qwen3_5", vocab=vocab,
                             sharpen=16.0 if vocab > 8 else 2.0)
        _built[vocab] = (folder, *load(str(folder)))
    return _built[vocab]


def smaller_qwen3_5(target, layers=2, noise=0.5):
    """A Qwen3.5 draft: the target's first `layers` layers (one recurrent, one attention),
    with a perturbed final norm so that it is wrong now and then."""
    text = dict(target.args.text_config, num_hidden_layers=layers)
    draft = qwen3_5.Model(qwen3_5.ModelArgs(model_type="qwen3_5", text_config=text))
    keep = dict((k, v) for k, v in tree_flatten(target.parameters())
                if ".layers." not in k or int(k.split(".layers.")[1].split(".")[0]) < layers)
    norm = "language_model.model.norm.weight"
    rng = np.random.default_rng(layers)
    keep[norm] = keep[norm] * mx.array(1 + noise * rng.standard_normal(keep[norm].shape), mx.float32)
    draft.load_weights(list(keep.items()))
    mx.eval(draft.parameters())
    return draft


def drafters(folder, model):
    return {
        "mtp": lambda: mlx_spec.load_drafter(folder, model, kind="mtp"),
        "ngram": lambda: NGramDrafter(min_n=1, max_n=3),
        "qwen3_5-draft": lambda: DraftModelDrafter(smaller_qwen3_5(model), min_confidence=None),
    }


@pytest.mark.parametrize("k", [2, 5])
@pytest.mark.parametrize("name", ["mtp", "ngram", "qwen3_5-draft"])
def test_greedy_output_is_the_hybrid_targets_own(root, name, k):
    folder, model, tok = hybrid(root)
    want = [int(t) for t, _ in generate_step(mx.array(PROMPT), model, max_tokens=48)]
    out = list(mlx_spec.stream_generate(model, tok, PROMPT, drafters(folder, model)[name](),
                                        max_tokens=48, num_draft_tokens=k))
    assert [r.token for r in out] == want
    s = out[-1].stats
    assert s.accepted > 0
    if name != "ngram":  # (prompt lookup may well be right every time it proposes)
        assert s.accepted < s.drafted  # rejected blocks too: rollback was exercised


# ---- sampling: chi-square against the exact marginals (vocabulary of 8) -----

V8 = 8
PROMPT8 = [1, 2, 3, 1, 2]
RUNS = {"mtp": 1000, "qwen3_5-draft": 600}


@pytest.mark.slow
@pytest.mark.parametrize("name", ["mtp", "qwen3_5-draft"])
def test_sampled_output_has_the_hybrid_targets_distribution(root, name):
    """3-token drafts (max_tokens = 5) on the hybrid target, so rejections after accepted
    drafts replay kept tokens through the recurrent layers: marginals of positions 1..4
    and neighbouring pairs against np_sampler's exact law. (Prompt lookup is left out:
    on this short prompt it rarely offers 3 tokens, the replay does not depend on q, and
    point-mass sampling at depth is tested in test_lossless_sampling.py.)"""
    folder, model, tok = hybrid(root, V8)
    kw = dict(temp=1.0, top_k=6)
    joint = exact_joint(model, PROMPT8, 5, kw, vocab=V8)
    drafter = drafters(folder, model)[name]()
    runs = sampled_runs(model, PROMPT8, lambda: drafter, RUNS[name], max_tokens=5, k=3,
                        vocab=V8, **kw)
    assert_deep(runs, events=40)
    assert_lossless(runs, joint)


# ---- rollback property ------------------------------------------------------

def assert_same_cache(got, want, tol=5e-5):
    """Equal states up to float32 rounding: batched and per-token matmuls round
    differently (OpenBLAS more than the reference BLAS), so `tol` is relative to
    each tensor's largest entry; a real rollback bug differs by O(1)."""
    for i, (a, b) in enumerate(zip(got, want)):
        assert type(a) is type(b), f"layer {i}"
        if isinstance(a, ArraysCache):  # conv state, recurrent state
            pairs = zip(a.cache, b.cache)
        else:
            assert a.offset == b.offset, f"layer {i}"
            pairs = zip(a.keys_and_values(), b.keys_and_values())  # up to the offset
        for x, y in pairs:
            y = np.array(y)
            np.testing.assert_allclose(np.array(x), y, rtol=0, atol=tol * max(1.0, np.abs(y).max()),
                                       err_msg=f"layer {i}")


def greedy_continuation(model, tokens, n):
    return [int(t) for t, _ in generate_step(mx.array(tokens), model, max_tokens=n)] if n else []


# (block size k, drafts the target should keep, seed for the wrong token after them)
blocks = st.lists(st.tuples(st.integers(1, 16), st.integers(0, 16), st.integers(0, 2**31 - 1)),
                  min_size=1, max_size=6)


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(blocks=blocks, prompt_len=st.integers(1, 10))
def test_verifier_rollback_on_a_hybrid_target_equals_a_fresh_cache(blocks, prompt_len):
    model = _tiny_hybrid()
    prompt = np.random.default_rng(prompt_len).integers(0, tiny.VOCAB, prompt_len).tolist()
    cache = make_cache(model)
    row = Row(0, model, tiny.tokenizer(), Request(prompt=tuple(prompt)), None, cache, None)
    y, _ = verify.prefill(model, row)
    committed = prompt + [y]  # the target has consumed all but y
    for k, keep, seed in blocks:
        keep = min(keep, k)
        good = greedy_continuation(model, committed, keep)  # drafts the target agrees with
        bad = np.random.default_rng(seed).integers(0, tiny.VOCAB, k - keep).tolist()
        row.y = y
        v, = verify.verify(model, cache, [row], [Draft(mx.array(good + bad, mx.uint32))])
        assert v.n >= keep
        committed += v.proposed[: v.n] + [v.token]
        y = v.token
    fresh = make_cache(model)
    model(mx.array(committed[:-1])[None], cache=fresh)
    assert_same_cache(cache, fresh)
    got, want = model(mx.array([[y]]), cache=cache), model(mx.array([[y]]), cache=fresh)
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=0, atol=5e-5 * float(mx.abs(want).max()))


def _tiny_hybrid():
    if "tiny" not in _built:
        _built["tiny"] = tiny.qwen3_5_model()
    return _built["tiny"]


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(steps=st.lists(st.tuples(st.integers(1, 8), st.integers(0, 8), st.integers(0, 95)),
                      min_size=1, max_size=6))
def test_mtp_cache_rollback_equals_a_fresh_prefill(steps):
    folder, model, tok = _BUILT_MTP
    stack = decoder_stack(model)
    hidden = lambda seq: stack(mx.array(seq)[None])[0]  # noqa: E731  target h at every position
    drafter = mlx_spec.load_drafter(folder, model, kind="mtp")
    drafter.bind(model, tok)
    seq = list(PROMPT)
    drafter.prefill(seq, {FINAL_NORM: hidden(seq)})
    y = 3
    for k, n, nxt in steps:  # pretend the target kept n of k drafts, then said `nxt`
        d = drafter.propose(y, k, Sampling()).tokens.tolist()
        kept = [y] + d[: min(n, k)]
        rows = hidden(seq + kept)[len(seq):]
        drafter.commit(kept, {FINAL_NORM: rows})
        seq, y = seq + kept, nxt
    fresh = mlx_spec.load_drafter(folder, model, kind="mtp")
    fresh.bind(model, tok)
    fresh.prefill(seq, {FINAL_NORM: hidden(seq)})
    s = Sampling(temp=1.0)
    q_got, q_want = drafter.propose(y, 1, s).q, fresh.propose(y, 1, s).q
    assert_same_cache(drafter.cache, fresh.cache)
    np.testing.assert_allclose(np.array(q_got), np.array(q_want), atol=1e-5)


# ---- what rollback costs ------------------------------------------------------

class _CountTokens(nn.Module):
    """Wraps a decoder layer (instance only) and counts the positions it processes."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner
        self.counted = [0]

    def __getattr__(self, key):
        if key in self:
            return self[key]
        if "inner" not in self:
            raise AttributeError(key)
        return getattr(self["inner"], key)

    def __call__(self, x, *args, **kwargs):
        self.counted[0] += x.shape[1]
        return self.inner(x, *args, **kwargs)


@pytest.mark.parametrize("name", ["mtp", "ngram"])
def test_replay_costs_n_plus_one_positions_on_rejected_steps_only(root, name):
    folder, model, tok = hybrid(root)
    drafter = drafters(folder, model)[name]()
    stack = decoder_stack(model)
    counter = _CountTokens(stack.layers[0])
    stack.layers[0] = counter
    try:
        out = list(mlx_spec.stream_generate(model, tok, PROMPT, drafter, max_tokens=40,
                                            num_draft_tokens=4, trace=True))
    finally:
        stack.layers[0] = counter.inner
    trace = out[-1].stats.trace
    verify = sum(len(t.proposed) + 1 for t in trace)
    rejected = [t for t in trace if t.accepted < len(t.proposed)]
    replay = sum(t.accepted + 1 for t in rejected)
    # Every position layer 0 saw: the prompt, each verify block, each replay; nothing else.
    assert counter.counted[0] == len(PROMPT) + verify + replay
    assert rejected or name == "ngram"
    print(f"\n{name}: {len(trace)} verify steps, {verify} verified positions, {len(rejected)} "
          f"with a rejection, {replay} replayed positions ({replay / verify:.0%} extra)")


@pytest.mark.slow
def test_measure_rollback_cost():
    """Print the time of a verify forward and of the replay a rejection adds (no assertions
    on speed: the machine is shared). Run with -s to see the table."""
    mx.random.seed(0)
    text = dict(model_type="qwen3_5_text", hidden_size=512, intermediate_size=1024,
                num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
                vocab_size=4096, linear_num_value_heads=8, linear_num_key_heads=4,
                linear_key_head_dim=64, linear_value_head_dim=64, linear_conv_kernel_dim=4,
                full_attention_interval=4, tie_word_embeddings=False, rms_norm_eps=1e-6)
    model = qwen3_5.Model(qwen3_5.ModelArgs(model_type="qwen3_5", text_config=text))
    mx.eval(model.parameters())
    rows = measure(model, context=256, k=4)
    for what, ms in rows.items():
        print(f"{what:<44} {ms:7.2f} ms")
    assert all(v == v for v in rows.values())  # timings only; see docs/mtp.md


def measure(model, context: int, k: int, reps: int = 30) -> dict[str, float]:
    """CPU time (ms) of the pieces of a step on `model` after `context` tokens.

    Process CPU time, the variants interleaved and the minimum over repetitions
    kept: the least disturbed by other processes on a shared machine.
    """
    cache = make_cache(model)
    model(mx.array([[t % 100 for t in range(context)]]), cache=cache)
    mx.eval([c.state for c in cache])
    block = [7] * (k + 1)

    def forward(ckpt):
        mx.eval(model(mx.array([block[:1]]), cache=cache))
        return 1

    def verify_keep(n_keep):
        def step(ckpt):
            mx.eval(model(mx.array([block]), cache=cache))
            ckpt.keep(block[:n_keep], k + 1)  # n_keep < k + 1: restore + replay
            return n_keep
        return step

    variants = {"plain decode forward (1 token)": forward,
                f"verify forward ({k + 1} tokens), all kept": verify_keep(k + 1),
                f"verify ({k + 1}) + replay of 1 kept": verify_keep(1),
                f"verify ({k + 1}) + replay of {k} kept": verify_keep(k)}
    best = dict.fromkeys(variants, float("inf"))
    for _ in range(reps):
        for name, step in variants.items():
            ckpt = Checkpoint(model, cache)
            t0 = time.process_time()  # CPU time of this process: the work, not the waiting
            held = step(ckpt)  # positions the cache holds past the checkpoint
            mx.eval([c.state for c in cache])
            best[name] = min(best[name], (time.process_time() - t0) * 1e3)
            ckpt.keep([], held)  # back to `context` for the next one
    full = best[f"verify forward ({k + 1} tokens), all kept"]
    for n_keep in (1, k):
        best[f"  extra for the replay of {n_keep}"] = best[f"verify ({k + 1}) + replay of {n_keep} kept"] - full
    return best


_BUILT_MTP = None


@pytest.fixture(scope="module", autouse=True)
def _mtp_target(root):
    global _BUILT_MTP
    _BUILT_MTP = hybrid(root)
