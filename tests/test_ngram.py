"""Prompt lookup on literal token lists."""

import pytest

from mlx_spec import NGramDrafter
from mlx_spec.drafters.ngram import NGramIndex
from mlx_spec.sampling import Sampling

G = Sampling()


def proposal(context, y, k=4, **kw):
    d = NGramDrafter(**kw)
    d.bind(None, None)
    d.prefill(context, None)
    return d.propose(y, k, G).tokens.tolist()


def test_longest_match_wins():
    # Suffix (7, 8) after 1-gram-matching 8 elsewhere: the 2-gram's continuation wins.
    ctx = [8, 50, 51, 7, 8, 60, 61, 62, 7]
    assert proposal(ctx, 8, min_n=1, max_n=3) == [60, 61, 62, 7]


def test_most_recent_occurrence_wins():
    ctx = [3, 4, 10, 11, 3, 4, 20, 21, 3]
    assert proposal(ctx, 4, k=2, min_n=2, max_n=2) == [20, 21]


def test_no_match_proposes_nothing():
    assert proposal([1, 2, 3, 4], 9) == []
    assert proposal([1, 2, 3, 4], 4, min_n=2) == []  # (4, 4) never occurred


def test_continuation_runs_into_y_and_then_into_itself():
    # [5, 6] occurred ending right before y's position: the continuation is y itself, then
    # what it has proposed so far (the text repeats with that period).
    assert proposal([1, 5, 6, 5], 6, k=3, min_n=2, max_n=2) == [5, 6, 5]


def test_k_limits_the_proposal():
    assert proposal([1, 2, 3, 4, 5, 6, 1], 2, k=2) == [3, 4]


def test_corpus_is_a_fallback_only():
    d = NGramDrafter(min_n=2, max_n=2, corpus=[9, 1, 2, 70, 71])
    d.bind(None, None)
    d.prefill([5, 1], None)
    assert d.propose(2, 2, G).tokens.tolist() == [70, 71]  # context has no (1, 2)
    d.commit([2, 40, 41, 1], None)
    assert d.propose(2, 2, G).tokens.tolist() == [40, 41]  # now the context has it


def test_corpus_file_is_tokenized(tmp_path):
    import tiny

    path = tmp_path / "corpus.txt"
    path.write_text("w3 w4 w5 w6")
    d = NGramDrafter(min_n=2, max_n=2, corpus=path)
    d.bind(None, tiny.tokenizer())
    d.prefill([1, 3], None)
    assert d.propose(4, 2, G).tokens.tolist() == [5, 6]
    with pytest.raises(ValueError, match="not found"):
        NGramDrafter(corpus=tmp_path / "missing.txt").bind(None, tiny.tokenizer())


def test_index_is_incremental_and_bounded_per_token():
    idx = NGramIndex(1, 3)
    idx.extend([1, 2, 3])
    size = len(idx.ends)
    idx.extend([4])
    assert len(idx.ends) - size <= 3  # one entry per n at most
    assert idx.ends[(2, 3, 4)] == (3,)
    idx.extend([2, 3, 4] * (NGramIndex.KEEP + 2))
    assert len(idx.ends[(2, 3, 4)]) == NGramIndex.KEEP  # only the latest ends are kept
    assert idx.ends[(2, 3, 4)][-1] == len(idx.tokens) - 1


def test_a_saved_index_is_apart_from_the_live_one():
    """Saved drafter states copy the index cheaply (its end tuples are shared, never changed in
    place): extending the live index leaves a saved copy as it was, and the other way round."""
    import copy

    idx = NGramIndex(1, 3)
    idx.extend([1, 2, 3, 1, 2])
    saved = copy.deepcopy(idx)
    idx.extend([3, 1, 2, 4])
    assert saved.tokens == [1, 2, 3, 1, 2] and saved.ends[(1, 2)] == (1, 4)
    assert idx.ends[(1, 2)] == (1, 4, 7) and (2, 4) not in saved.ends
    saved.extend([9])
    assert (2, 9) in saved.ends and (2, 9) not in idx.ends and len(idx.tokens) == 9


@pytest.mark.parametrize("kw", [dict(min_n=0), dict(min_n=3, max_n=2), dict(min_n=True), dict(min_n=1.5),
                                dict(max_n=4.0), dict(min_n="2"), dict(branches=True)])
def test_bad_n_is_refused(kw):
    """(A float min_n or max_n failed only later, inside the first prefill.)"""
    with pytest.raises(ValueError, match="min_n <= max_n" if "branches" not in kw else "branches"):
        NGramDrafter(**kw)


def test_lookup_measures_its_match_and_drafts_a_repeating_run_in_full():
    d = NGramDrafter()
    d.prefill([1, 2, 3, 4, 5, 6, 7, 1, 2, 3, 4, 5], None)
    draft = d.propose(6, 3, Sampling())
    assert draft.tokens.tolist() == [7, 1, 2] and d.matched == 6  # 1 2 3 4 5 6 seen before
    d = NGramDrafter()
    d.prefill([8, 9, 9, 9], None)
    assert d.propose(9, 5, Sampling()).tokens.tolist() == [9] * 5  # not [9] alone
    d = NGramDrafter()
    d.prefill([5, 1, 2, 3, 1, 2], None)  # ... 1 2 3 1 2 | 3: the line repeats
    assert d.propose(3, 7, Sampling()).tokens.tolist() == [1, 2, 3, 1, 2, 3, 1]
