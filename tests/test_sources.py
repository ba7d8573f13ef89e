"""`auto` with a mixed drafter: one source a step (prompt lookup or the draft model), chosen by
the cost model, the free source scored on every step it had a draft; lossless either way."""

from types import SimpleNamespace

import pytest

import mlx_spec
import tiny
from mlx_spec import calibration, learned, row_lengths
from mlx_spec.adaptive import AdaptiveK, CostModel
from mlx_spec.learned import _load_learned, save_learned
from mlx_spec.calibration import model_key
from mlx_spec.sources import FREE, PAID, SourceChoice
from runs import mlx_lm_greedy as reference

VERIFY = [1.0 + 0.05 * n for n in range(17)]  # verify cost of n = 1..17 tokens
DRAFT_TOKEN = 0.05  # a draft model's one-token forward, in the same units (cheap: it drafts cold)


class Lookup:
    """A stand-in for a mixed drafter as the policy sees it: committed tokens and a free draft."""

    def __init__(self, context, ahead, matched=2):
        self.tokens, self.ahead, self.only, self.matched = list(context), list(ahead), None, matched
        self.read, self.backlog = True, 0  # a draft model that has read the prompt
        self.paid_off = False  # (`MixedDrafter.shed` not called)

    def context(self):
        return self.tokens

    def peek(self, y, k):
        return self.ahead[:k], self.matched if self.ahead else 0


def policy_with(free_accept: float, paid_accept: float, seen: int = 50) -> SourceChoice:
    policy = SourceChoice(CostModel(VERIFY, DRAFT_TOKEN), k_max=8)
    for p, a in ((policy.free, free_accept), (policy, paid_accept)):
        p.accept = [[a] * 8 for _ in range(2)]
        p.seen = [[seen] * 8 for _ in range(2)]
    return policy


class Row(SimpleNamespace):
    pass  # (weakly referenced)


def serve(policy, drafter, y=5):
    row = Row(drafter=drafter, y=y)
    policy.serve(row)
    return row  # (the policy holds it weakly: keep it alive)


@pytest.mark.parametrize("free_accept, paid_accept, ahead, source", [
    (0.9, 0.8, [1, 2, 3, 4, 5, 6, 7, 8], FREE),  # a lookup that copies: free beats paying
    (0.9, 0.95, [1, 2, 3, 4, 5, 6, 7, 8], FREE),  # a little worse, but its drafts cost nothing
    (0.2, 0.8, [1, 2, 3, 4, 5, 6, 7, 8], PAID),  # chat-like lookups: short and wrong
    (0.9, 0.8, [], PAID),  # no match: nothing free to weigh
])
def test_each_step_drafts_from_the_source_expected_to_pay_most(free_accept, paid_accept, ahead, source):
    policy, drafter = policy_with(free_accept, paid_accept), Lookup([1, 2, 3], ahead)
    row = serve(policy, drafter)
    k, gain = policy.choose()
    assert k > 0 and policy.source == source == drafter.only
    chosen = policy.free if source == FREE else policy
    assert k == max(range(9), key=chosen.rates().__getitem__)  # that source's own best k
    assert k >= 3
    policy.observe(k, 2, None)  # the step's outcome goes to the source that drafted it
    assert chosen.seen[0][2] == 51 and drafter.only is None and policy.source is None
    other = policy if source == FREE else policy.free
    assert other.seen[0][2] == 50 and other.state == 0 and chosen.state == 1
    del row


def test_a_long_match_and_a_short_one_are_weighed_by_their_own_acceptance():
    """A copy in progress (8+ tokens matched) pays; a 2-token coincidence does not."""
    policy = policy_with(0.2, 0.8)
    long_class = policy.frees[-1]
    long_class.accept = [[0.95] * 8 for _ in range(2)]
    long_class.seen = [[50] * 8 for _ in range(2)]
    for matched, source in ((2, PAID), (12, FREE), (3, PAID), (8, FREE), (7, PAID)):
        drafter = Lookup([1, 2, 3], [4, 5, 6, 7, 8, 9], matched)
        row = serve(policy, drafter)
        policy.choose()
        assert policy.source == source, matched
        policy.observe(0, 0, None, plain_by_choice=True)
    del row


def test_a_lookup_is_weighed_at_the_tokens_it_found_not_at_a_longer_draft():
    """The free source's gain is its best rate over drafts it can make: a lookup that found 1
    token is weighed at k <= 1. Weighed at its unconstrained best k (the wrong rule), a
    1-token lookup of a reliable source beat a draft model that would propose 8."""
    policy, drafter = policy_with(0.95, 0.9), Lookup([1, 2, 3], [4])
    row = serve(policy, drafter)
    unconstrained = max(policy.free.rates()) * policy.free.seconds(0)
    k, gain = policy.choose()
    assert policy.source == PAID and k > 1 and gain < unconstrained
    policy.observe(0, 0, None, plain_by_choice=True)
    drafter.ahead = [4, 5, 6, 7, 8, 9, 10, 11]  # a lookup that found a long continuation wins
    k, _ = policy.choose()
    assert policy.source == FREE and k > 1
    del row


def test_after_a_free_step_the_model_starts_afresh_not_within_a_run():
    """The paid policy's second table is for steps after one of its own kept drafts. A step
    after lookup's is taught to the first: lookup drafts until the copy ends, where the
    model's next token is hardest. Taught to the table of runs (the wrong rule), those
    steps made the model look poor within a run everywhere else."""
    policy, drafter = policy_with(0.95, 0.8), Lookup([1, 2, 3], [4, 5, 6, 7, 8, 9])
    row = serve(policy, drafter)
    policy.state = 1  # the model's last draft was kept
    k, _ = policy.choose()
    assert policy.source == FREE
    policy.observe(k, k, None)  # lookup copied
    drafter.tokens += [5, 4, 5, 6, 7, 8, 9]
    drafter.ahead, row.y = [], 1  # the copy ended: nothing to look up
    before = [row_[:] for row_ in policy.accept]
    k, _ = policy.choose()
    assert policy.source == PAID and k > 0
    policy.observe(k, 0, None)  # the model missed where the copy ended
    assert policy.accept[1] == before[1] and policy.accept[0][0] < before[0][0]
    del row


def test_after_a_free_draft_lost_at_its_first_token_the_model_keeps_its_own_state():
    """A short lookup that was wrong at once (JSON's, often) says nothing about the draft
    model: its next step is weighed, and taught, in the state of its own last step. Under the
    fresh-start rule for every free step, each wrong lookup left the model on its cautious
    table, where lookup won again."""
    policy, drafter = policy_with(0.95, 0.8), Lookup([1, 2, 3], [4, 5])
    row = serve(policy, drafter)
    policy.state = 1  # the model's last draft was kept
    k, _ = policy.choose()
    assert policy.source == FREE
    policy.observe(k, 0, None)  # the lookup's first token was wrong
    drafter.tokens, drafter.ahead, row.y = drafter.tokens + [5], [], 6  # nothing to look up now
    assert policy.state == 1
    before = [row_[:] for row_ in policy.accept]
    k, _ = policy.choose()
    assert policy.source == PAID and k > 0
    policy.observe(k, k, None)  # the model's draft, all kept: taught to the table of runs
    assert policy.accept[0] == before[0] and policy.accept[1][0] > before[1][0]
    del row


def test_a_free_draft_that_lost_is_scored_against_the_tokens_the_target_emitted():
    """Known up to the emitted tokens: kept while it matches, the first mismatch rejected,
    positions beyond the emitted tokens not observed at all."""
    policy, drafter = policy_with(0.5, 0.99), Lookup([1, 2, 3], [9, 8, 7, 6])
    row = serve(policy, drafter, y=4)
    policy.choose()
    assert policy.source == PAID and policy.guess[:2] == (4, [9, 8, 7, 6])  # after 1 2 3 and y = 4
    policy.observe(2, 1, None)  # the draft model's step: two drafted, one kept, then 7 emitted
    drafter.tokens += [4, 9]  # committed: y and the kept token; 7 is the next input
    before = policy.free.seen[0][:]
    row.y = 7
    policy.choose()
    seen, accept = policy.free.seen[0], policy.free.accept[0]
    assert seen[:2] == [before[0] + 1, before[1] + 1]  # 9 kept, 8 seen and rejected (7 came)
    assert seen[2:] == before[2:] and accept[1] < 0.5 < accept[0]
    assert policy.free.state == 1  # its first token was kept


def test_a_free_draft_longer_than_what_was_emitted_leaves_the_rest_unobserved():
    policy, drafter = policy_with(0.5, 0.99), Lookup([1, 2, 3], [9, 8, 7, 6])
    row = serve(policy, drafter, y=4)
    policy.choose()
    policy.observe(0, 0, None, plain_by_choice=True)  # (say, a plain step)
    drafter.tokens += [4]
    row.y = 9
    seen = policy.free.seen[0][:]
    policy.choose()
    assert policy.free.seen[0][0] == seen[0] + 1 and policy.free.seen[0][1:] == seen[1:]
    assert policy.free.accept[0][0] > 0.5  # kept, and nothing after it counted as rejected


def test_what_both_sources_learned_is_kept_for_the_next_process(tmp_path):
    policy = policy_with(0.85, 0.6)
    policy.frees[1].accept[0][0] = 0.7
    save_learned(policy, tmp_path / "p.json")
    again = SourceChoice(CostModel(VERIFY, DRAFT_TOKEN), k_max=8)
    _load_learned(again, tmp_path / "p.json")
    assert [p.accept[0][0] for p in again.frees] == pytest.approx([0.85, 0.7, 0.4])  # (0.4: prior)
    assert again.accept[0][0] == pytest.approx(0.6)


@pytest.fixture
def costs(monkeypatch, tmp_path):
    target = tiny.llama_model(seed=2)
    draft = tiny.llama_model(seed=2, layers=1)  # (another shape: its own calibration key)
    monkeypatch.setattr(calibration, "_CURVES", {model_key(target): VERIFY, model_key(draft): [DRAFT_TOKEN]})
    monkeypatch.setattr(learned, "policy_dir", lambda: tmp_path)
    return target, draft


def test_a_mixed_request_drafts_from_both_sources_and_keeps_the_target_output(costs, monkeypatch):
    """Lookup has nothing before the output starts repeating, then copies: the draft model
    drafts the first steps, prompt lookup the repeats; every token is the target's."""
    target, draft = costs
    prompt = [5, 6, 7, 8, 9, 5, 6, 7, 3]
    want = reference(target, prompt, 40)
    mixed = mlx_spec.MixedDrafter(mlx_spec.NGramDrafter(min_n=1), mlx_spec.DraftModelDrafter(draft))
    asked = {"NGramDrafter": 0, "DraftModelDrafter": 0}
    for member in mixed.drafters:
        def spy(y, k, sampling, propose=member.propose, name=type(member).__name__):
            asked[name] += 1
            return propose(y, k, sampling)
        member.propose = spy
    served = []
    monkeypatch.setattr(SourceChoice, "serve", lambda self, row, serve=SourceChoice.serve: (
        served.append(self), serve(self, row)))
    out = list(mlx_spec.stream_generate(target, tiny.tokenizer(), prompt, mixed, max_tokens=40, seed=0))
    assert [r.token for r in out] == want
    (policy,) = served
    assert policy.picks[FREE] > 0 and policy.picks[PAID] > 0
    assert asked["DraftModelDrafter"] == policy.picks[PAID]  # the model drafts only when it is picked
    assert out[-1].stats.accepted > 0


def test_mixed_rows_in_a_batch_merge_both_sources_and_stay_lossless(costs):
    target, draft = costs
    prompts = [[5, 6, 7, 8, 9, 5, 6, 7, 3], [4, 4, 9, 2, 4, 4]]
    make = lambda: mlx_spec.MixedDrafter(mlx_spec.NGramDrafter(min_n=1), mlx_spec.DraftModelDrafter(draft))  # noqa: E731
    got = mlx_spec.batch_generate(target, tiny.tokenizer(), prompts, make, max_tokens=24)
    assert got.tokens == [reference(target, p, 24) for p in prompts]
    assert sum(s.accepted for s in got.stats) > 0


def test_a_draft_model_that_has_not_read_the_prompt_waits_while_lookup_has_a_draft():
    """A lookup step costs about a plain one; reading a long prompt into the draft model
    costs a forward over all of it: while lookup copies (a match of 4 or more), the read waits
    for a step lookup has nothing for."""
    policy, drafter = policy_with(0.5, 0.99), Lookup([1, 2, 3], [9, 8, 7, 6])
    row = serve(policy, drafter)
    assert policy.choose()[0] > 0 and policy.source == PAID  # read: the better source drafts
    policy.observe(0, 0, None)
    drafter.read, drafter.backlog, drafter.matched = False, 300, 4  # the prompt, not read yet
    assert policy.choose()[0] > 0 and policy.source == FREE  # a copy under way: no read yet
    policy.observe(0, 0, None)
    drafter.matched = 2  # a short match (an answer's opening words): weighed as on any step
    assert policy.choose()[0] > 0 and policy.source == PAID
    policy.observe(0, 0, None)
    drafter.matched = 4
    drafter.backlog = 20  # a few tokens: read with the next proposal
    assert policy.choose()[0] > 0 and policy.source == PAID
    policy.observe(0, 0, None)
    drafter.ahead, drafter.backlog = [], 300  # nothing free: the draft model (the read weighed later)
    assert policy.choose()[0] > 0 and policy.source == PAID
    del row



def test_a_mixed_drafter_without_a_file_of_its_own_starts_from_its_draft_models(costs):
    """What the draft model learned drafting alone is what the paid source does; a file written
    when the members' drafts were merged (no per-source tables) is not taken."""
    target, draft = costs
    alone = mlx_spec.DraftModelDrafter(draft)
    kept = learned.policy_for(target, alone, 16)
    kept.accept = [[0.93] * 16 for _ in range(2)]
    kept.seen = [[9] * 16 for _ in range(2)]
    save_learned(kept, learned.policy_file(target, alone, None))
    mixed = mlx_spec.MixedDrafter(mlx_spec.NGramDrafter(), mlx_spec.DraftModelDrafter(draft))
    merged = learned.policy_file(target, mixed, None)
    merged.write_text('{"accept": [[0.5, 0.5], [0.5, 0.5]], "seen": [[1, 1], [1, 1]]}')
    policy = learned.policy_for(target, mixed, 16)
    assert isinstance(policy, SourceChoice)
    assert policy.accept[0][0] == pytest.approx(0.93) and policy.frees[0].accept[0][0] == pytest.approx(0.4)


def test_the_read_is_weighed_at_the_gain_left_by_this_requests_free_steps():
    """After lookup drafted most of this request, the draft model's expected gain (what the
    row weighs the prompt read against) shrinks to what it adds on the steps left to it,
    whatever earlier requests showed."""
    policy, drafter = policy_with(0.9, 0.95), Lookup([1, 2, 3], [9, 8, 7, 6, 5, 4, 3, 2])
    row = serve(policy, drafter)
    drafter.ahead = []
    fresh = policy.choose()[1]
    policy.observe(0, 0, None)
    drafter.ahead = [9, 8, 7, 6, 5, 4, 3, 2]
    for _ in range(6):
        policy.choose()
        assert policy.source == FREE
        policy.observe(0, 0, None)
    drafter.ahead = []
    policy.free_share = 0.0  # as if earlier requests had left lookup nothing: this one counts
    after = policy.choose()[1]
    assert policy.source == PAID and 1.0 < after < 1.0 + 0.5 * (fresh - 1.0), (fresh, after)
    del row


def test_the_read_is_hoped_for_at_this_requests_share_not_the_earlier_ones():
    """Earlier requests were code edits (lookup drafted 95% of their steps): at a JSON
    request's first step, where lookup finds nothing, the draft model's read is weighed at
    its whole hopeful gain. Discounted by the earlier share (the wrong rule) it looked worth
    5% of that, so the request never read the prompt and went on with lookup alone."""
    policy, drafter = policy_with(0.9, 0.95), Lookup([1, 2, 3], [])
    policy.free_share = 0.95
    row = serve(policy, drafter)
    whole = AdaptiveK.hopeful_gain(policy)
    assert whole > 2.0 and policy.hopeful_gain() == pytest.approx(whole)
    drafter.ahead = [9, 8, 7, 6, 5, 4, 3, 2]
    for _ in range(4):  # this request's own free steps do count
        policy.choose()
        assert policy.source == FREE
        policy.observe(0, 0, None)
    assert policy.hopeful_gain() < 1.0 + 0.5 * (whole - 1.0)
    del row


def test_a_request_whose_read_does_not_pay_goes_on_with_lookup_under_the_mixed_tables(costs):
    """When reading the prompt into the draft model cannot pay, lookup drafts the rest of the
    request alone, weighed by the tables this mixed policy learned for it on every step it had
    a match for. Handed to the n-gram member's own policy (the wrong rule), which a mixed
    drafter never teaches, lookup drafted from a near-cold table: 6 of 40 tokens from drafts
    on a code edit (`add-type-hints`, 2.9 tok/s against 5.8 for the draft model alone)."""
    target, _ = costs
    policy, drafter = policy_with(0.95, 0.9), Lookup([1, 2, 3], [9, 8, 7, 6, 5, 4, 3, 2])
    drafter.backlog, drafter.read = 300, False
    def shed():  # as `MixedDrafter.shed`: only the member with nothing to read proposes
        drafter.paid_off = True
        return mlx_spec.NGramDrafter()

    drafter.shed = shed
    row = serve(policy, drafter)
    row.__dict__.update(lengths=policy, uid=0, out=[], stats=SimpleNamespace(plain_reason=None),
               req=SimpleNamespace(max_tokens=40, sampling=None, repeatable=False))
    in_batch = row_lengths._without_backlog(target, row, alone=False)  # priced from its own costs
    assert in_batch is not policy and in_batch.costs.draft_per_token == 0.0
    drafter.paid_off = False
    assert row_lengths._without_backlog(target, row) is policy and drafter.paid_off
    k, _ = policy.choose()
    assert policy.source == FREE and k == 8  # the copy's table: 0.95 a token
    policy.observe(k, k, None)
    drafter.ahead = []
    assert policy.choose() == (0, 1.0) and policy.source == FREE  # no match: a plain step
    policy.observe(0, 0, None)
    drafter.paid_off = False  # the next request (`MixedDrafter.bind`: every member proposes)
    policy.serve(row)  # weighs the draft model again
    assert policy.choose()[0] > 0 and policy.source == PAID
