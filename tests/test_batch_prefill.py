"""Rows that start together read their prompts together (`verify.prefill_together`): one
left-padded forward for the prompts, one for their last tokens, and each row's own cache then
holds what a prefill alone leaves; rows that cannot (a quantized cache to come, a prompt over
one chunk) are read alone."""

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.sample_utils import make_repetition_penalty

import mlx_spec
import tiny
from mlx_spec import BatchDecoder, NGramDrafter, verify
from runs import counted, mlx_lm_greedy as reference
from test_batch import PROMPTS, drain


def decoder_with(model, rows: list[dict], max_batch: int = 4) -> BatchDecoder:
    d = BatchDecoder(model, tiny.tokenizer(), max_batch=max_batch)
    for kw in rows:
        d.add(**{"max_tokens": 12, **kw})
    return d


def test_the_rows_caches_and_first_tokens_are_what_a_prefill_alone_gives():
    m = tiny.llama_model()
    penalty = make_repetition_penalty(1.8, 8)  # reads the row's own history
    rows = [dict(prompt=p) for p in PROMPTS[:3]] + [dict(prompt=PROMPTS[3], logits_processors=[penalty])]
    rows[2].update(temp=0.9, seed=3)
    together, alone = decoder_with(m, rows).waiting, decoder_with(m, rows).waiting
    got = verify.prefill_together(m, together)
    for (y, lp), a in zip(got, alone):
        want_y, want_lp = verify.prefill(m, a)
        b = together[alone.index(a)]
        assert y == want_y and b.consumed == a.consumed == len(a.req.prompt)
        np.testing.assert_allclose(np.array(lp), np.array(want_lp), atol=1e-4)
        for c, w in zip(b.cache, a.cache):
            n = len(a.req.prompt)
            assert c.offset == w.offset == n
            for x, z in ((c.keys, w.keys), (c.values, w.values)):
                np.testing.assert_allclose(np.array(x[..., :n, :]), np.array(z[..., :n, :]), atol=1e-5)
        assert b.prefill_time[0] == len(a.req.prompt) - 1


def test_rows_starting_together_are_read_in_one_forward_and_decode_as_alone(monkeypatch):
    m = tiny.llama_model()
    calls = []
    real = verify.prefill_together
    monkeypatch.setattr(verify, "prefill_together", lambda model, rows: calls.append(len(rows)) or real(model, rows))
    seen = counted(m)
    d = decoder_with(m, [dict(prompt=p, drafter=NGramDrafter(min_n=1), num_draft_tokens=3) for p in PROMPTS])
    out, widths = drain(d)
    assert calls == [4] and seen[:2] == [4, 4]  # the padded prompts, then the last tokens
    for uid, p in enumerate(PROMPTS):
        assert out[uid] == reference(m, p, 12)


@pytest.mark.parametrize("odd", ["kv_bits", "long prompt"])
def test_a_row_that_cannot_be_read_together_is_read_alone(monkeypatch, odd):
    """It ends the group at its place in the queue: the rows before it are read together,
    it and the rows after it one by one; every output is still its solo output."""
    m = tiny.llama_model()
    calls = []
    real = verify.prefill_together
    monkeypatch.setattr(verify, "prefill_together", lambda model, rows: calls.append(len(rows)) or real(model, rows))
    extra = dict(kv_bits=8, quantized_kv_start=1000) if odd == "kv_bits" else dict(prefill_step_size=4)
    rows = [dict(prompt=p) for p in PROMPTS]
    rows[2].update(extra)  # PROMPTS[2] has 13 tokens: more than a 4-token chunk
    out, _ = drain(decoder_with(m, rows))
    assert calls == [2]
    for uid, p in enumerate(PROMPTS):
        assert out[uid] == reference(m, p, 12)


def test_seeded_sampled_rows_read_together_draw_what_they_draw_alone():
    m = tiny.llama_model()
    kw = dict(max_tokens=10, temp=1.0, num_draft_tokens=2)
    alone = [[r.token for r in mlx_spec.stream_generate(m, tiny.tokenizer(), p, NGramDrafter(min_n=1), seed=s, **kw)]
             for s, p in enumerate(PROMPTS)]
    res = mlx_spec.batch_generate(m, tiny.tokenizer(), PROMPTS, lambda: NGramDrafter(min_n=1),
                                  seed=[0, 1, 2, 3], **kw)
    assert res.tokens == alone
    assert mx.array(alone).size > 0


def test_rows_arriving_while_others_decode_are_read_together_within_one_chunk(monkeypatch):
    """Two rows decode; three more arrive. The first two of them (13 + 5 tokens) fit one
    20-token prefill chunk and are read in one forward on the next step; the third (8 more)
    would not, so it is read alone after them. Every output is still its solo output."""
    m = tiny.llama_model()
    calls = []
    real = verify.prefill_together
    monkeypatch.setattr(verify, "prefill_together", lambda model, rows: calls.append(len(rows)) or real(model, rows))
    d = BatchDecoder(m, tiny.tokenizer(), max_batch=5, prefill_chunk=20)
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[2], PROMPTS[3], PROMPTS[0]]
    first = [d.add(p, NGramDrafter(min_n=1), max_tokens=12, num_draft_tokens=3) for p in prompts[:2]]
    out = {}

    def step():  # (a row's first token and its first verified block come as two events)
        for uid, block in d.step():
            out.setdefault(uid, []).extend(r.token for r in block)

    step()
    assert calls == [2] and d.width == 0  # the step ended with the prefill: first tokens out
    assert [len(out[uid]) for uid in first] == [1, 1]
    later = [d.add(p, NGramDrafter(min_n=1), max_tokens=12, num_draft_tokens=3) for p in prompts[2:]]
    step()
    assert calls == [2, 2] and d.width == 4  # the two joined the batch in the same step
    drain(d, collect=out)
    assert calls == [2, 2]  # the third was read alone
    for uid, p in zip(first + later, prompts):
        assert out[uid] == reference(m, p, 12)


class Left(Exception):
    pass


@pytest.mark.parametrize("when", ["read together", "read alone", "joining a decoding row"])
def test_a_row_whose_progress_callback_raises_stops_alone(when):
    """A server's client that leaves during its prompt's read stops its row by raising from the
    row's progress callback: that row ends, the step raises the error, and every other row goes
    on with nothing lost (its first token or block comes from the next step) and its own output."""
    m = tiny.llama_model()
    a_prompt, b_prompt = PROMPTS[0], (PROMPTS[2] if when == "read together" else list(range(2, 90)) * 2)

    def leave(done, total):
        raise Left

    d = BatchDecoder(m, tiny.tokenizer(), max_batch=4)
    a = d.add(a_prompt, NGramDrafter(min_n=1), max_tokens=12, num_draft_tokens=3)
    out = {}
    if when == "joining a decoding row":
        drain_steps = [d.step() for _ in range(2)]  # a decodes
        for events in drain_steps:
            for uid, block in events:
                out.setdefault(uid, []).extend(r.token for r in block)
    b = d.add(b_prompt, None, max_tokens=12, prompt_progress_callback=leave)
    with pytest.raises(Left):
        d.step()
    assert b in d.done and not any(r.uid == b for r in d.waiting + d.active)
    d.release(b)
    got, _ = drain(d, out)
    assert got[a] == reference(m, a_prompt, 12) and b not in got
