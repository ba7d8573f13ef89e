"""Each row's draft-length policy (`draft_lengths`: `AdaptiveK` for auto, `FixedK` otherwise)
and this step's lengths for every row (`choose_lengths`, one row or many: a batch's rows
are combined by `mlx_spec.batch_policy`), including the one-time check that a drafter's
first read of its backlog pays (`Row.drafting_pays`)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from .adaptive import FixedK
from .batch_policy import _costs, _repeatable, _seconds, choose_for_batch, probe_soon
from .cache import MAX_DRAFT
from .learned import policy_for

if TYPE_CHECKING:
    from .rows import Row

log = logging.getLogger("mlx_spec")


def draft_lengths(model, row: Row, recurrent: bool):
    drafter, req = row.drafter, row.req
    if drafter is None:
        return FixedK(0)
    k_max = min(drafter.max_draft, MAX_DRAFT)
    if req.num_draft_tokens == "auto":
        policy = policy_for(model, drafter, k_max, replays=recurrent, sampling=req.sampling,
                            seeded=req.repeatable)
        policy.together = getattr(drafter, "together", lambda: None)()  # (batch_policy's costs)
        policy.solo = req.repeatable and not req.sampling.greedy
        policy.start_request()
        probe_soon(model)  # a parked batch probes soon for a new request, as one alone does
        if hasattr(policy, "serve"):  # `SourceChoice`: it looks up this row's free draft
            policy.serve(row)
        return policy
    return FixedK(min(req.num_draft_tokens, k_max))


def choose_lengths(model, rows: list[Row]) -> list[tuple[int, float | None]]:
    """Each row's draft length for this step: its own policy alone, the batch's choice together.
    A row whose drafter's first read of its backlog would cost more than drafting can save
    decodes plainly from here on (`Row.drafting_pays`). On a sharded target every rank takes
    rank 0's choices (timings differ between ranks)."""
    policies = [r.lengths for r in rows]
    if len(rows) == 1:
        choices = [rows[0].lengths.choose()]
    else:
        choices = choose_for_batch(model, policies)
    if all(isinstance(p, FixedK) for p in policies):
        return choices
    # In a batch a row's drafting saves it its share of the batch's plain step, not a step alone.
    share = _seconds(model, policies, [0] * len(rows), _costs(model), drafting=False) / len(rows) \
        if len(rows) > 1 else None
    from .agreed import agree_lengths, agree_sources

    choices = agree_lengths(model, [(-1, None) if k and gain is not None and not row.drafting_pays(
        gain, None if _repeatable(row.lengths) else share) else (k, gain) for row, (k, gain) in zip(rows, choices)])
    agree_sources(model, [r.drafter for r in rows])
    for row, (k, _) in zip(rows, choices):
        if k < 0:
            row.lengths = _without_backlog(model, row, alone=len(rows) == 1 or _repeatable(row.lengths))
    return [(max(k, 0), gain) for k, gain in choices]


def _without_backlog(model, row: Row, alone: bool = True):
    """The policy of a row whose drafter's read of its backlog does not pay: a mixed drafter
    goes on with the member that has nothing to read (n-gram), under the tables the mixed
    policy keeps for it when the row decodes alone (`SourceChoice`'s `frees`: they learned from
    every step it had a match for, where the member's own policy may have learned nothing;
    in a batch, where lengths are priced from a policy's own tables and costs, a mixed
    policy's would charge the draft model), or else under that member's own policy; any
    other row decodes plainly to the end. (A mixed policy sees the shed member in
    `MixedDrafter.paid_off`.)"""
    what = (f"request {row.uid}: reading {row.drafter.backlog} tokens into the draft model costs more "
            f"than drafting can save in the {row.req.max_tokens - len(row.out)} tokens left")
    rest = getattr(row.drafter, "shed", lambda: None)()
    if rest is None:
        log.info("%s; it decodes plainly", what)
        row.stats.plain_reason = "backlog"
        return FixedK(0)
    log.info("%s; it drafts with %s alone", what, type(rest).__name__)
    if alone and getattr(row.lengths, "frees", None) is not None:  # `SourceChoice`: lookup's tables
        return row.lengths
    row.policy_owner = rest  # what this policy learns is the member's (`Row._keep_learned`)
    policy = policy_for(model, rest, row.lengths.k_max, replays=row.lengths.replays,
                        sampling=row.req.sampling, seeded=row.req.repeatable)
    policy.solo = _repeatable(row.lengths)  # (a seeded row's lengths stay its own)
    return policy
