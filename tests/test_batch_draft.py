"""Draft-model rows of a batch draft together: one batched draft forward per depth for every
row drafting with the same draft model, each drafter left exactly as its own proposal would
have left it (`DraftModelDrafter.propose_together`)."""

import pytest

import mlx_spec
import tiny
from mlx_spec import BatchDecoder, DraftModelDrafter, NGramDrafter
from mlx_spec.sampling import Sampling
from runs import assert_same_draft_state, counted, median_confidence, mlx_lm_greedy as reference, together_as_alone

PROMPTS = [[5, 6, 7, 8, 9, 5, 6, 7], [3, 4], [9, 9, 8, 7, 6, 5, 4, 3, 2, 1, 9, 9, 8],
           [40, 41, 40, 41, 40]]


def drafters_with_history(target, draft, n: int, min_confidence=None) -> list[DraftModelDrafter]:
    """`n` forks of one draft-model drafter, with different histories and different queued
    tokens (so their first block in a step is ragged)."""
    base, out = DraftModelDrafter(draft, min_confidence=min_confidence), []
    for i in range(n):
        d = base.fork()
        d.bind(target, None)
        d.prefill(PROMPTS[i], None)
        d.commit(list(range(10, 10 + 3 * i)), None)  # tokens kept on plain steps: queued
        out.append(d)
    return out


@pytest.mark.parametrize("stops", [False, True])  # True: chains end after an unsure token
@pytest.mark.parametrize("mixed", [True, False])  # False: all greedy (one argmax for the rows)
def test_drafting_together_leaves_each_drafter_as_its_own_proposal_would(mixed, stops):
    target, draft = tiny.llama_model(), tiny.llama_model(seed=9, layers=2)
    sure = median_confidence(draft, [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16]) if stops else None
    together, alone = (drafters_with_history(target, draft, 4, sure) for _ in range(2))
    sizes = []
    samplings = [Sampling(), Sampling(temp=0.8), Sampling(temp=1.2, top_p=0.9), Sampling()]
    samplings = samplings if mixed else [Sampling()] * 4
    for step, (ks, kept) in enumerate([([3, 1, 4, 2], [2, 1, 0, 2]), ([2, 4, 3, 1], [2, 4, 3, 0])]):
        ys = [11 + step, 23, 31, 47]
        got = together_as_alone(together, alone, ys, ks, samplings, [7 * step + i for i in range(4)])
        sizes += [(d.size, k) for d, k in zip(got, ks) if k > 1]
        for i, (a, b) in enumerate(zip(together, alone)):  # commit a prefix of each draft
            block = [ys[i]] + got[i].tokens.tolist()[: kept[i]]
            a.commit(block, None)
            b.commit(block, None)
            assert_same_draft_state(a, b)
    assert all(n == k for n, k in sizes) != stops  # with stops, some chains ended early


def test_a_batch_of_draft_model_rows_drafts_once_per_depth_and_keeps_every_rows_output():
    model, draft = tiny.llama_model(), tiny.llama_model(seed=9, layers=2)
    seen = counted(draft)
    base = DraftModelDrafter(draft)
    makers = [base.fork, base.fork, lambda: NGramDrafter(min_n=1), base.fork]
    res = mlx_spec.batch_generate(model, tiny.tokenizer(), PROMPTS, lambda: makers.pop(0)(),
                                  max_tokens=24, num_draft_tokens=3)
    for prompt, got in zip(PROMPTS, res.tokens):
        assert got == reference(model, prompt, 24)
    together = [b for b in seen if b == 3]  # the three draft-model rows, one forward per depth
    assert len(together) >= 3 * 5  # at least five steps drafted 3 deep together
    # Alone, every row would have drafted with forwards of its own; together, drafting costs
    # k forwards a step (plus each row's prefill), not k per row.
    steps = max(len(s.batch_sizes) for s in res.stats)
    assert sum(1 for b in seen if b == 1) <= 3 + 3 * (steps - len(together) // 3)


def test_requests_given_draft_model_draft_together():
    """`draft_model=` (mlx-lm's keyword) gives each request a drafter of that model: together."""
    model, draft = tiny.llama_model(), tiny.llama_model(seed=9, layers=2)
    seen = counted(draft)
    res = mlx_spec.batch_generate(model, tiny.tokenizer(), PROMPTS[:3], draft_model=draft,
                                  max_tokens=16, num_draft_tokens=3)
    for prompt, got in zip(PROMPTS, res.tokens):
        assert got == reference(model, prompt, 16)
    assert seen.count(3) >= 3 * 3


def test_a_seeded_row_samples_the_same_alone_or_drafting_together():
    model, draft = tiny.llama_model(), tiny.llama_model(seed=9, layers=2)
    kw = dict(max_tokens=25, num_draft_tokens=3, temp=0.9, seed=11)
    solo = [r.token for r in mlx_spec.stream_generate(model, tiny.tokenizer(), PROMPTS[0],
                                                       DraftModelDrafter(draft), **kw)]
    seen = counted(draft)
    base = DraftModelDrafter(draft)
    decoder = BatchDecoder(model, tiny.tokenizer(), max_batch=4)
    uid = decoder.add(PROMPTS[0], base.fork(), **kw)
    decoder.add(PROMPTS[1], base.fork(), max_tokens=25, temp=1.3, num_draft_tokens=2)
    decoder.add(PROMPTS[2], base.fork(), max_tokens=25, num_draft_tokens=4, seed=3)
    out = {}
    while decoder.busy:
        for u, block in decoder.step():
            out.setdefault(u, []).extend(r.token for r in block)
            if block and block[-1].finish_reason is not None:
                decoder.release(u)
    assert out[uid] == solo
    assert seen.count(3) >= 4 * 5  # drafted together (k = 4 at most: four forwards a step)


@pytest.mark.parametrize("why", ["tree", "other model"])
def test_drafters_that_cannot_draft_together_propose_alone(why):
    model, draft = tiny.llama_model(), tiny.llama_model(seed=9, layers=2)
    other = tiny.llama_model(seed=9, layers=2)  # the same weights, another object
    if why == "tree":
        makers = [lambda: DraftModelDrafter(draft, branches=2), lambda: DraftModelDrafter(draft)]
    else:
        makers = [lambda: DraftModelDrafter(draft), lambda: DraftModelDrafter(other)]
    seen = counted(draft)
    res = mlx_spec.batch_generate(model, tiny.tokenizer(), PROMPTS[:2], lambda: makers.pop(0)(),
                                  max_tokens=16, num_draft_tokens=4)
    for prompt, got in zip(PROMPTS, res.tokens):
        assert got == reference(model, prompt, 16)
    assert max(max(s.batch_sizes) for s in res.stats) == 2 and set(seen) == {1}
