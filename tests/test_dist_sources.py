"""On a sharded target every rank must verify the same draft (and draw the same random numbers,
and use the same verify cost curve). A mixed drafter's source for a
step (prompt lookup or the draft model, `MixedDrafter.only`) is weighed from each rank's own
measured costs, so it is agreed like the draft length: rank 0's choice on every rank. Two
ranks are simulated in one process (rank 0's broadcasts are replayed to rank 1), rank 1's
draft model measured 100x cheaper than rank 0's."""

from __future__ import annotations

import collections

import pytest

import mlx_spec
import tiny
from lossless import v8_successor_llama
from mlx_spec import agreed, batch_policy, calibration, distributed, learned
from mlx_spec.adaptive import CostModel
from mlx_spec.drafters import DraftModelDrafter, MixedDrafter, NGramDrafter

PROMPT = [0, 1, 2, 3, 4, 5, 6, 7] * 3 + [0, 1, 2, 3]
DRAFT_COST = 0.3  # rank 0's draft-model forward, against 1.1 for a one-token target forward


def run_two_ranks(monkeypatch, steps: int) -> int:
    """Steps at which the two ranks proposed different drafts (same agreed lengths)."""
    rank, sent = [0], collections.deque()

    def broadcast_ints(group, values):  # rank 0 steps first; rank 1 takes what it sent, in order
        if rank[0] == 0:
            sent.append(list(values))
            return list(values)
        return sent.popleft()

    monkeypatch.setattr(distributed, "shard_of", lambda model: type("Shard", (), {"group": None}))
    monkeypatch.setattr(agreed, "broadcast_ints", broadcast_ints)
    monkeypatch.setattr(agreed, "agreed_curve", lambda model, local, measure: local or measure())
    proposed = {}
    propose = MixedDrafter.propose

    def spy(self, y, k, sampling):
        draft = propose(self, y, k, sampling)
        proposed.setdefault(rank[0], []).append((k, draft.tokens.tolist(), draft.q is None))
        return draft

    monkeypatch.setattr(MixedDrafter, "propose", spy)
    target, draft = v8_successor_llama(), v8_successor_llama(gain=0.6)
    decoders = []
    for r in (0, 1):
        rank[0] = r
        d = mlx_spec.BatchDecoder(target, tiny.tokenizer(vocab=8), max_batch=1)
        d.add(PROMPT, MixedDrafter(NGramDrafter(), DraftModelDrafter(draft)), max_tokens=steps, temp=1.0,
              seed=7, num_draft_tokens="auto")
        d.step()  # the prefill
        decoders.append(d)
    for d, per_token in zip(decoders, (DRAFT_COST, DRAFT_COST / 100)):
        policy = d.active[0].lengths
        policy.costs = CostModel(policy.costs.verify, per_token)
    for _ in range(steps):
        if not all(d.busy for d in decoders):
            break
        for r in (0, 1):
            rank[0] = r
            decoders[r].step()
    assert sum(q for _, _, q in proposed[0]) >= 3 and sum(not q for _, _, q in proposed[0]) >= 3  # both sources
    return sum(a != b for a, b in zip(proposed[0], proposed[1]))


@pytest.fixture
def synthetic_costs(monkeypatch):
    monkeypatch.setattr(learned, "verify_seconds", lambda model, n_max=calibration.N_MAX, recalibrate=False:
                        [1 + 0.1 * n for n in range(1, n_max + 1)])
    monkeypatch.setattr(batch_policy, "wide_verify_seconds", lambda model: [1 + 0.1 * w for w in batch_policy.WIDE])


def test_every_rank_drafts_from_rank_0s_source(monkeypatch, synthetic_costs):
    assert run_two_ranks(monkeypatch, 60) == 0


def test_ranks_left_to_choose_their_own_source_diverge(monkeypatch, synthetic_costs):
    """The check above can fail: without the agreement the ranks' drafts differ."""
    monkeypatch.setattr(agreed, "agree_sources", lambda model, drafters: None)
    assert run_two_ranks(monkeypatch, 60) >= 1


def test_ranks_sampling_without_a_seed_draw_rank_0s_tokens(monkeypatch):
    """A sampled request without `seed` draws its random stream at random: on a sharded target
    every rank must draw rank 0's (each its own: tensor ranks mixed different tokens' partial
    sums, pipeline ranks fell out of step)."""
    sent, rank, told = collections.deque(), [0], []

    def broadcast_ints(group, values):
        if rank[0] == 0:
            sent.append(list(values))
            told.append(values)
            return list(values)
        return sent.popleft()

    monkeypatch.setattr(distributed, "shard_of", lambda model: type("Shard", (), {"group": None}))
    monkeypatch.setattr(agreed, "broadcast_ints", broadcast_ints)
    monkeypatch.setattr(agreed, "agreed_curve", lambda model, local, measure: local or measure())
    target = v8_successor_llama()
    runs = {}
    for r in (0, 1):
        rank[0] = r
        runs[r] = [[t.token for t in mlx_spec.stream_generate(target, tiny.tokenizer(vocab=8), PROMPT, drafter,
                                                             max_tokens=12, temp=1.0, num_draft_tokens=3)]
                   for drafter in (None, NGramDrafter())]
    assert runs[0] == runs[1] and len(told) >= 2
    # (greedy requests draw nothing: nothing is sent for them)
    rank[0], before = 0, len(told)
    list(mlx_spec.stream_generate(target, tiny.tokenizer(vocab=8), PROMPT, max_tokens=4))
    assert len(told) == before


def test_ranks_whose_cached_curves_differ_in_length_measure_one_together(monkeypatch):
    """Each rank may hold its own cached verify cost curve; one of another length (another
    version's) made the ranks sum arrays of different sizes (rank 0 got a wrong curve, rank 1
    lost its connection). Two ranks in two threads, all_sum through a barrier."""
    import threading
    import types

    import mlx.core as mx
    import numpy as np

    local, barrier, box = threading.local(), threading.Barrier(2, timeout=20), {}

    def all_sum(x, group=None):
        box[local.rank] = np.array(x)
        barrier.wait()
        total = box[0] + box[1]  # (arrays of different sizes fail here, as the real ring would)
        barrier.wait()
        return mx.array(total)

    shim = types.SimpleNamespace(array=mx.array, float32=mx.float32, int32=mx.int32,
                                 distributed=types.SimpleNamespace(all_sum=all_sum))
    monkeypatch.setattr(agreed, "mx", shim)
    monkeypatch.setattr(distributed, "shard_of", lambda model: local.shard)
    measured = {0: [float(i) for i in range(17)], 1: [float(100 + i) for i in range(17)]}
    out, errors = {}, []

    def rank(r, cached):
        group = types.SimpleNamespace(rank=lambda: r, size=lambda: 2)
        local.rank, local.shard = r, types.SimpleNamespace(group=group, rank=r, size=2)
        try:
            out[r] = agreed.agreed_curve(None, cached, lambda: measured[r])
        except Exception as e:  # noqa: BLE001 (reported below)
            errors.append(e)
            barrier.abort()

    for cached in ([[1.0] * 17, [2.0] * 25], [[1.0] * 17, [2.0] * 17]):
        box.clear()
        threads = [threading.Thread(target=rank, args=(r, c)) for r, c in enumerate(cached)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert not errors, errors
        want = measured[0] if len(cached[1]) != 17 else cached[0]  # measured anew / rank 0's own
        assert np.allclose(out[0], want) and np.allclose(out[1], want)
