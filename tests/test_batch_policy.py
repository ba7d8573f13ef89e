"""The batch's draft lengths in a real decode loop (`mlx_spec.batch_policy`): a step verifies
drafts only when what the rows actually proposed pays for the wider forward; while nothing
is accepted the batch probes rarely, and it drafts again once acceptance appears.

Costs are synthetic (a forward over w tokens costs 1 + 0.1 w) and every row is seeded, so
the policies learn from tokens only: the step counts below are exact, not timings."""

import statistics
import time

import mlx.core as mx
import pytest

import mlx_spec
import tiny
from mlx_spec import BatchDecoder, adaptive, batch_policy, calibration, learned
from mlx_spec.batch_policy import FixedK
from mlx_spec.taps import SeeThrough, decoder_stack
from mlx_spec.drafters.base import EMPTY
from runs import mlx_lm_greedy as reference

PROMPTS = [[5, 6, 7, 8, 9, 5, 6, 7], [3, 4, 3, 1, 2, 9, 8, 7], [9, 9, 8, 7, 6, 5, 4, 3],
           [40, 41, 40, 41, 40, 1, 2, 3]]


def cost(w: int) -> float:
    return 1 + 0.1 * w


@pytest.fixture
def synthetic_costs(monkeypatch, untimed_seeded_rows):
    monkeypatch.setattr(learned, "verify_seconds",
                        lambda model, n_max=calibration.N_MAX, recalibrate=False: [cost(n) for n in range(1, n_max + 1)])
    monkeypatch.setattr(batch_policy, "wide_verify_seconds", lambda model: [cost(w) for w in batch_policy.WIDE])


class Scripted:
    """Proposes from the row's known greedy continuation `want`: `mode["how"]` is "right" (the
    next tokens), "first" (the next token, then wrong ones), "wrong" (never the next token)
    "none" (nothing: an n-gram miss) or "rarely" (the next tokens at a fifth of positions, else
    nothing: an n-gram drafter on chat)."""

    max_draft = 8
    taps = ()

    def __init__(self, want: list[int], mode: dict):
        self.want, self.mode, self.pos = want, mode, 0

    def bind(self, model, tokenizer):
        self.pos = 0  # index in `want` of the row's current last token

    def prefill(self, tokens, taps):
        pass

    def propose(self, y, k, sampling):
        how = self.mode["how"]
        assert y == self.want[self.pos]
        self.asked = getattr(self, "asked", 0) + 1
        nxt = self.want[self.pos + 1 : self.pos + 1 + k]
        if how == "none" or not nxt or (how == "rarely" and self.pos * 7919 % 10 >= 2):
            return EMPTY
        wrong = [(t + 1) % tiny.VOCAB for t in nxt]
        tokens = {"right": nxt, "rarely": nxt, "first": nxt[:1] + wrong[1:], "wrong": wrong}[how]
        return mlx_spec.Draft(mx.array(tokens, mx.uint32))

    def commit(self, tokens, taps):
        self.pos += len(tokens)


def start(modes: list[dict], n: int):
    model = tiny.llama_model()  # a fresh model: no batch costs learned by other tests
    decoder = BatchDecoder(model, tiny.tokenizer(), max_batch=len(modes))
    wants = [reference(model, p, n + 20) for p in PROMPTS[: len(modes)]]
    uids = [decoder.add(p, Scripted(w, m), max_tokens=n, num_draft_tokens="auto", seed=0, trace=True)
            for p, w, m in zip(PROMPTS, wants, modes)]
    out = {uid: [r.token for r in block] for uid, block in decoder.step()}  # the prefill's step
    assert decoder.width == 0 and all(out[uid] == want[:1] for uid, want in zip(uids, wants))
    return decoder, uids, wants, out


def run(decoder, steps: int, out: dict) -> list[bool]:
    """`steps` batch steps; for each, whether it verified any draft. Checks every row's
    tokens so far against its greedy output."""
    drafted = []
    for _ in range(steps):
        proposed = False
        for uid, block in decoder.step():
            out.setdefault(uid, []).extend(r.token for r in block)
            trace = block[-1].stats.trace if block else None
            proposed |= bool(trace) and bool(trace[-1].proposed)
        assert decoder.width == len(decoder.active) > 1
        drafted.append(proposed)
    return drafted


def test_rows_with_nothing_to_propose_do_not_force_a_drafting_step(synthetic_costs):
    """One row's drafter gets its first token right, three find nothing: verifying one row's
    draft widens all four rows' forward for one expected token more, which does not pay, so
    the batch parks: its only drafted steps are probes, at growing intervals (a kept probe
    token that would not pay if it held is no reason to look again sooner). When every row
    proposes the same, drafting pays and most steps draft."""
    lone = [{"how": "first"}] + [{"how": "none"} for _ in range(3)]
    decoder, uids, wants, out = start(lone, 100)
    drafted = run(decoder, 40, out)
    at = [i for i, d in enumerate(drafted) if d]
    assert 1 <= len(at) <= 3 and all(b - a < c - b for a, b, c in zip(at, at[1:], at[2:]))
    for uid, want in zip(uids, wants):
        assert out[uid] == want[: len(out[uid])]

    decoder, uids, wants, out = start([{"how": "first"} for _ in range(4)], 100)
    assert sum(run(decoder, 40, out)) >= 30
    for uid, want in zip(uids, wants):
        assert out[uid] == want[: len(out[uid])]


@pytest.mark.parametrize("wrong_rule", [False, True])
def test_rows_that_rarely_propose_leave_the_batch_plain(synthetic_costs, monkeypatch, wrong_rule):
    """Four rows whose drafters find something at a fifth of positions (and are then right):
    a batch that assumed every row proposes K would ask for drafts on every step (so no
    plain step could be queued ahead); counting the misses, it parks and probes (a probe is
    asked again until some row answers it). The
    wrong rule (misses not counted) asks on nearly every step."""
    if wrong_rule:
        monkeypatch.setattr(adaptive.AdaptiveK, "offered", lambda self, asked, proposed: None)
    decoder, uids, wants, out = start([{"how": "rarely"}] * 4, 400)
    run(decoder, 20, out)  # learning
    drafters = [r.drafter for r in decoder.active]
    before = [d.asked for d in drafters]
    run(decoder, 60, out)
    asked_steps = max(d.asked - b for d, b in zip(drafters, before))
    assert (asked_steps >= 55) if wrong_rule else (asked_steps <= 45)
    for uid, want in zip(uids, wants):
        assert out[uid] == want[: len(out[uid])]


def test_a_batch_that_never_hits_probes_rarely_and_drafts_again_when_acceptance_appears(synthetic_costs):
    mode = {"how": "wrong"}
    decoder, uids, wants, out = start([mode] * 4, 600)
    drafted = run(decoder, 140, out)
    assert drafted.index(False) <= 12  # a cold start learns within a few steps that drafts are wrong
    assert sum(drafted[20:]) <= 5  # then probes at growing intervals: 4, 8, 16, 32, 64 steps
    mode["how"] = "right"  # the drafts become the target's own continuation
    drafted = []
    while len(drafted) < 140 and not all(drafted[-8:] or [False]):
        drafted += run(decoder, 1, out)
    # the next probe keeps its token, the follow-ups come sooner, and drafting pays again
    assert len(drafted) < 140 and all(drafted[-8:])
    for uid, want in zip(uids, wants):
        assert out[uid] == want[: len(out[uid])]


def test_a_new_process_starts_from_the_batch_costs_the_last_one_measured(synthetic_costs, monkeypatch):
    """Verifying in a batch costs what the calibrated forwards do plus overheads that only
    batched steps show; what one process measured, the next starts from."""
    from mlx_spec.adaptive import AdaptiveK, CostModel

    model = tiny.llama_model()
    rows = [AdaptiveK(CostModel([cost(n) for n in range(1, 18)]), k_max=4) for _ in range(4)]
    for _ in range(batch_policy.SAVE_EVERY):
        batch_policy.observe_batch(model, rows, [1, 1, 0, 0], 3 * batch_policy._seconds(model, rows, [1, 1, 0, 0], None))
    monkeypatch.setattr(batch_policy, "_BATCH", batch_policy.IdentityMap())  # a new process
    costs = batch_policy._costs(model)
    assert costs.correction(4, 2) == pytest.approx(3.0)
    assert costs.correction(4, 3) == pytest.approx(3.0)  # unobserved: the nearest width's
    assert costs.correction(2, 2) == 1.0  # nothing known with two rows
    # A plain step never takes a verify's ratio (that includes the drafters' time), nor the reverse.
    assert costs.correction(4, 1) == 1.0
    batch_policy.observe_batch(model, rows, [0, 0, 0, 0], 0.5 * batch_policy._seconds(model, rows, [0, 0, 0, 0], None))
    assert costs.correction(4, 1) == pytest.approx(0.5) and costs.correction(4, 5) == pytest.approx(3.0)


@pytest.mark.parametrize("together", [True, False])
def test_rows_drafting_together_pay_one_draft_forward_per_depth(synthetic_costs, together):
    """Four draft-model rows whose drafts would be kept 90% of the time, drafting at half a
    forward's cost a token: alone, each row's drafting costs more than the tokens it wins,
    and the batch decodes plainly; together (one batched draft forward per depth for all
    four) the same drafts pay and the batch drafts."""
    costs = adaptive.CostModel([cost(n) for n in range(1, 17)], draft_per_token=0.5)
    policies = []
    for i in range(4):
        p = adaptive.AdaptiveK(costs, 4, timed=False)
        p.accept = [[0.9] * 4 for _ in p.accept]
        p.seen = [[50] * 4 for _ in p.seen]
        p.together = ("draft model", 1) if together else None
        policies.append(p)
    (K, _), *_ = batch_policy.choose_for_batch(tiny.llama_model(), policies)
    assert (K > 0) == together


class Slow(SeeThrough):
    """Every forward through the wrapped layer costs `pause` seconds of host work more."""

    pause = 0.05

    def __call__(self, x, *args, **kwargs):
        time.sleep(self.pause)
        return self.inner(x, *args, **kwargs)


def slowed(model, pause: float):
    stack = decoder_stack(model)
    stack.layers[0] = Slow(stack.layers[0])
    stack.layers[0].pause = pause
    return model


def test_only_plain_steps_that_launch_one_forward_teach_their_cost(monkeypatch):
    """A pipelined plain step builds the next step before reading its own tokens. The first
    one after a drafting step launches two forwards (its own and the next), the last one
    none; neither wall time is a plain step's cost, so only the steps in between are
    learned from. Timed all alike (the wrong rule), the first plain step after a drafting
    step would cost two forwards, and parking would look dearer than it is."""
    model = slowed(tiny.llama_model(), 0.05)  # every forward: 50 ms of host work to build
    timed = []
    monkeypatch.setattr(FixedK, "observe", lambda self, proposed, accepted, s, **kw: timed.append(s))
    decoder = BatchDecoder(model, tiny.tokenizer(), max_batch=1)
    decoder.add(PROMPTS[0], None, max_tokens=8)
    walls = []
    while decoder.busy:
        tic = time.perf_counter()
        for uid, block in decoder.step():
            if block and block[-1].finish_reason is not None:
                decoder.release(uid)
        walls.append(time.perf_counter() - tic)
    assert walls[0] >= 0.1 and timed[0] is None  # two forwards built: not learned from
    assert timed[-1] is None  # the last step built none (its own was in flight)
    # each step between costs one forward's build (50 ms); their median is under two
    # forwards' (a busy machine, e.g. the suite's other worker, can delay a step or two)
    assert len(timed) == 7 and all(s >= 0.05 for s in timed[1:-1])
    assert 0.05 <= statistics.median(timed[1:-1]) < 0.09


def test_a_step_that_waits_for_a_calibration_is_timed_without_it(monkeypatch, tmp_path):
    """Four rows drafting need the batched verify curve (up to 136 tokens), measured on the
    first batched step. Timed with it (the wrong rule), that step would
    teach the batch that its shape costs many times what it does."""
    monkeypatch.setattr(calibration, "cache_dir", lambda: tmp_path)
    monkeypatch.setattr(calibration, "_CURVES", {})
    model = slowed(tiny.llama_model(hidden=48, heads=3, kv_heads=1), 0.004)
    seen, real = [], batch_policy.observe_batch
    monkeypatch.setattr(batch_policy, "observe_batch",
                        lambda m, policies, ks, s: seen.append(s) or real(m, policies, ks, s))
    decoder = BatchDecoder(model, tiny.tokenizer(), max_batch=4)
    for p in PROMPTS:
        decoder.add(p, mlx_spec.NGramDrafter(min_n=1), max_tokens=12, num_draft_tokens="auto")
    before = calibration.one_time_seconds()
    while decoder.busy:
        for uid, block in decoder.step():
            if block and block[-1].finish_reason is not None:
                decoder.release(uid)
    assert calibration.one_time_seconds() - before > 0.5  # the wide curve was measured mid-run
    assert seen and max(seen) < 0.3


def test_a_batch_looks_one_token_deeper_after_rows_kept_all_they_drafted(synthetic_costs):
    """As one row's policy does (`test_adaptive`): a fifth draft position learned low holds K at
    4 until a step in which the rows kept every draft token; then the batch tries K = 5 while
    that position is little known (the old rule kept K = 4)."""
    model = tiny.llama_model()
    policies = []
    for _ in range(2):
        p = adaptive.AdaptiveK(adaptive.CostModel([cost(n) for n in range(1, 18)], 0.2), k_max=8)
        p.state, p.accept[1][:5], p.seen[1][:5] = 1, [1.0, 1.0, 1.0, 1.0, 0.3], [20, 20, 20, 20, 3]
        policies.append(p)
    assert [k for k, _ in batch_policy.choose_for_batch(model, policies)] == [4, 4]
    for p in policies:
        p.observe(4, 4)
    assert [k for k, _ in batch_policy.choose_for_batch(model, policies)] == [5, 5]
    for p in policies:
        p.seen[1][4] = adaptive.CURIOUS  # well known (and low): no more looking
    assert [k for k, _ in batch_policy.choose_for_batch(model, policies)] == [4, 4]


def test_a_sampled_draft_is_weighed_at_the_length_it_was_asked_for(synthetic_costs):
    """Whether a rejection-sampled draft token is verified must never depend on the token
    itself, and a draft model's chain ends after a token it was unsure of: its length says
    how sure it was of its last token. So a batch's cut weighs a draft drawn from q at the
    length it was asked for, and its own length only caps the cut: over many step-shaped cost
    curves, a row whose chain ended at its second token is cut as one that ran to the asked
    8, up to its length. Point masses (n-gram drafts) are weighed at their length, and these
    curves do make the cut depend on it (the check can fail)."""
    import random

    model = tiny.llama_model()

    def policy(curve, a):
        p = adaptive.AdaptiveK(adaptive.CostModel(curve), 8, timed=False)
        for s in range(len(p.accept)):
            p.accept[s], p.seen[s] = [a] * p.k_max, [5] * p.k_max
        return p

    def draft(n, sampled):
        q = mx.full((n, tiny.VOCAB), 1 / tiny.VOCAB) if sampled else None
        return mlx_spec.Draft(mx.arange(n).astype(mx.uint32), q)

    rng, depends = random.Random(0), 0
    for _ in range(400):
        steps = [rng.choice([0.0, 0.0, 0.0, 0.02, 0.5]) for _ in range(calibration.N_MAX)]
        curve = [1.0 + sum(steps[:n]) for n in range(1, calibration.N_MAX + 1)]
        a = rng.choice([0.5, 0.7, 0.9])

        def keep(n, sampled):
            return batch_policy.trim_drafts(model, [policy(curve, a), policy(curve, a)],
                                            [draft(8, False), draft(n, sampled)], [8, 8])

        ended, ran = keep(2, True), keep(8, True)
        assert ended == [ran[0], min(ran[1], 2)]
        depends += keep(2, False)[0] != keep(8, False)[0]
    assert depends >= 5


def test_a_new_request_makes_a_parked_batch_probe_soon():
    """As a lone request's policy does (`AdaptiveK.start_request`): the batch's probe schedule,
    grown while earlier rows never kept a draft, starts over when a request starts."""
    model = tiny.llama_model(seed=5)
    costs = batch_policy._costs(model)
    costs.parked, costs.probe_every = 20, batch_policy.PROBE_MAX
    decoder = BatchDecoder(model, tiny.tokenizer(), max_batch=2)
    decoder.add(PROMPTS[0], mlx_spec.NGramDrafter(), max_tokens=4)
    decoder.step()  # the prompt read; the row starts decoding
    assert (costs.parked, costs.probe_every) == (0, batch_policy.PROBE_FIRST)


@pytest.mark.parametrize("drafter", ["ngram", "draft-model"])
def test_a_seeded_sampled_row_on_auto_gets_its_solo_output_beside_any_rows(drafter):
    """A seed repeats a sampled request's output, batched or not: its draft lengths (and with them
    its random draws) are its own policy's, not the batch's joint choice (which made them depend
    on the other rows: most of these seeds came out otherwise), and its draft is never cut to
    the batch's length."""
    from test_batch import drain

    model, tok = tiny.llama_model(), tiny.tokenizer()
    make = (lambda: mlx_spec.NGramDrafter(min_n=1)) if drafter == "ngram" else \
        (lambda: mlx_spec.DraftModelDrafter(tiny.llama_model(seed=4), min_confidence=None))
    prompt = [1, 2, 3, 4, 1, 2, 3, 4, 1, 2]
    for seed in (11, 12, 13):
        kw = dict(max_tokens=60, temp=1.0, seed=seed, num_draft_tokens="auto")
        solo = list(mlx_spec.stream_generate(model, tok, prompt, make(), **kw))
        decoder = BatchDecoder(model, tok, max_batch=4)
        uid = decoder.add(prompt, make(), **kw)
        others = [decoder.add([5, 6, 7, 8] * 3 + [5, 6, 20 + i], make(), max_tokens=90) for i in range(3)]
        out, widths = drain(decoder)
        assert max(widths) == 4 and out[uid] == [r.token for r in solo], seed
        assert decoder.last_stats[uid].chosen_k == solo[-1].stats.chosen_k
        assert all(decoder.last_stats[u].drafted for u in [uid, *others])  # drafts ran in the batch
