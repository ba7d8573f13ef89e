"""Plain batched steps pipelined like mlx-lm's batch generator (`mlx_spec.batch_plain`): the
next step is queued on this step's lazy tokens before they are read. Every row still gets its
solo output; a step in flight is taken back whenever the batch changes (a row joins, stops or
is cancelled), on KV and recurrent caches; sampled rows keep the target's law."""

import pytest

import lossless as L
import tiny
from mlx_spec import BatchDecoder, NGramDrafter, batch_plain
from mlx_spec.rows import Row
from runs import mlx_lm_greedy as reference
from test_batch import PROMPTS, batched_runs, drain


@pytest.mark.parametrize("name", ["llama", "hybrid"])
def test_plain_rows_pipeline_and_each_gets_its_solo_output(name, monkeypatch):
    model = {"llama": tiny.llama_model, "hybrid": tiny.qwen3_5_model}[name]()
    want = reference(model, PROMPTS[0], 30)
    others = {t for p, n in zip(PROMPTS[1:], (25, 40, 12)) for t in reference(model, p, n)}
    stop = next(i for i in range(8, 30) if want[i] not in want[:i] and want[i] not in others)
    landed, flew = [], []
    real_land, real_launch = batch_plain.land, batch_plain.launch
    monkeypatch.setattr(batch_plain, "land", lambda f, rows: landed.append(f is not None) or real_land(f, rows))
    monkeypatch.setattr(batch_plain, "launch", lambda *a: flew.append(a[-1]) or real_launch(*a))
    decoder = BatchDecoder(model, tiny.tokenizer(eos=want[stop]), max_batch=4)  # row 0 stops there
    uids = [decoder.add(p, None, max_tokens=n) for p, n in zip(PROMPTS[:3], (30, 25, 40))]
    out = {uid: [r.token for r in block] for uid, block in decoder.step()}  # the prefill's step:
    assert decoder.flight is None and [len(out[u]) for u in uids] == [1, 1, 1]  # first tokens go out
    while len(out.get(uids[0], [])) <= stop:  # row 0 stops while the next step is in flight
        for uid, block in decoder.step():
            out.setdefault(uid, []).extend(r.token for r in block)
        assert decoder.flight is not None or uids[0] in decoder.done  # in flight between calls
    for _ in range(2):  # rows 1 and 2 go on together, pipelined again
        for uid, block in decoder.step():
            out.setdefault(uid, []).extend(r.token for r in block)
    assert decoder.flight is not None
    late = decoder.add(PROMPTS[3], NGramDrafter(min_n=1), max_tokens=12)  # joins: lands it
    out, widths = drain(decoder, out)
    assert out[uids[0]] == want[: stop + 1]
    for uid, p, n in zip(uids[1:], PROMPTS[1:3], (25, 40)):
        assert out[uid] == reference(model, p, n)
    assert out[late] == reference(model, PROMPTS[3], 12)
    assert max(widths) == 3 and sum(flew) >= 8 and sum(landed) >= 2  # row 0's stop, the join


def test_sampled_plain_rows_of_a_pipelined_batch_have_the_targets_law(monkeypatch):
    """Rows without drafters at different temperatures, all steps pipelined; a step's draws
    reusing another step's random stream (a wrong seeding) is caught."""
    model = L.v8_llama()
    cases = [([1, 2, 3, 1, 2], dict(temp=1.0), lambda: None),
             ([4, 5, 6], dict(temp=0.7, top_p=0.9), lambda: None)]
    joints = [L.exact_joint(model, p, 5, kw, vocab=8) for p, kw, _ in cases]
    for r, joint in zip(batched_runs(model, cases, 600), joints):
        L.assert_lossless(r, joint)
    real = Row.seed_rng
    monkeypatch.setattr(Row, "seed_rng", lambda self, phase, step=None: real(self, phase, 0))
    L.assert_caught(batched_runs(model, cases, 600)[0], joints[0])


@pytest.mark.usefixtures("untimed_seeded_rows")  # seeded: choices from costs and tokens only
def test_a_parked_single_row_pipelines_its_plain_steps_and_still_probes(monkeypatch):
    """One request whose drafter never hits: once `auto` parks drafting, its plain steps are
    queued ahead like drafter-less ones (a step in flight between calls), the policy's probes
    still come (and the step they replace is never queued, so none is taken back), and the
    output is plain decoding's."""
    import mlx.core as mx
    from mlx_spec import Draft, verify

    model = tiny.llama_model()
    want = reference(model, PROMPTS[2], 60)
    bad = next(t for t in range(64) if t not in want)

    class Wrong(NGramDrafter):
        def propose(self, y, k, sampling):
            return Draft(mx.full((k,), bad, mx.uint32))

    from mlx_spec import calibration, learned

    # a cost curve where each drafted token costs a tenth of a step (not this run's calibration)
    monkeypatch.setattr(learned, "verify_seconds", lambda model, n_max=calibration.N_MAX, recalibrate=False:
                        [0.01 * (1 + 0.1 * n) for n in range(n_max)])
    verifies, landed = [], []
    real_verify, real_land = verify.verify, batch_plain.land
    monkeypatch.setattr(verify, "verify", lambda *a: verifies.append(1) or real_verify(*a))
    monkeypatch.setattr(batch_plain, "land", lambda f, rows: landed.append(f is not None) or real_land(f, rows))
    decoder = BatchDecoder(model, tiny.tokenizer(), max_batch=1)
    # seeded (see the fixture): a fresh policy choosing from tokens alone (no timings, nothing learned before)
    uid = decoder.add(PROMPTS[2], Wrong(), max_tokens=60, num_draft_tokens="auto", seed=0)
    out, in_flight, probes_after = [], 0, 0
    while decoder.busy:
        before = len(verifies)
        for _, block in decoder.step():
            out.extend(r.token for r in block)
        in_flight += decoder.flight is not None
        probes_after += in_flight > 0 and len(verifies) > before
        if block and block[-1].finish_reason is not None:
            decoder.release(uid)
    assert out == want
    assert in_flight >= 20  # parked steps were pipelined
    assert probes_after >= 2  # and drafting was still tried now and then
    assert sum(landed[:-1]) == 0  # no queued step was wasted on a probe (the last: the end)
