"""What adaptive draft-length policies learn, kept.

In one process a policy stays with its drafter (per target, draft limit, recurrence and
sampling settings; a fork hands its policies back to its origin). Across processes it is
kept on disk per model (shapes and a fingerprint of the weights), drafter kind and sampling
mode, next to the calibration cache, so a fresh `mlx-spec generate` starts warm. What is
loaded counts as only a few observations and never starts more pessimistic than a cold
start (`adaptive._carried`): another process's text may differ.
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
from pathlib import Path

from . import calibration
from .adaptive import STATES, AdaptiveK, CostModel, _carried
from .calibration import model_key, verify_seconds, write_json
from .drafters import short_head
from .drafters.draft_model import MIN_CONFIDENCE
from .identity import IdentityMap

_POLICIES = IdentityMap()  # drafter -> {(model_key, weights_key, k_max, replays, sampling): AdaptiveK}
_WEIGHTS = IdentityMap()  # model -> [weights_key]


def policy_for(model, drafter, k_max: int, replays: bool = False, sampling=None,
               seeded: bool = False, recalibrate: bool = False) -> AdaptiveK:
    """The adaptive policy for this target, drafter and sampling settings.

    What a policy learned (acceptance per position, the cost curve's real
    shape) carries over to the next call with the same drafter, target and
    sampling settings. A `seeded` call gets a fresh policy that ignores step
    timings, so its choices depend only on the (cached) calibration and the
    tokens: a seeded run repeats exactly.
    """
    verify = verify_seconds(model, recalibrate=recalibrate)
    draft_model = getattr(drafter, "model", None)
    per_token = verify_seconds(draft_model, n_max=1, recalibrate=recalibrate)[0] if draft_model is not None else 0.0

    def fresh() -> AdaptiveK:
        from .sources import SourceChoice  # a mixed drafter with a free member: one source a step

        kind = SourceChoice if getattr(drafter, "free_member", None) is not None else AdaptiveK
        # Blocks run at a cheaper wider width where one exists; not on recurrent targets, where
        # the filler would be a rejection to replay every step (`verify.padded_width`).
        costs = CostModel(verify, per_token) if replays else CostModel.padded(verify, per_token)
        return kind(costs, k_max, replays=replays, timed=not seeded)

    if seeded:
        return fresh()
    known = _POLICIES.setdefault(drafter, dict)
    key = (model_key(model), weights_key(model), k_max, replays, sampling)
    if recalibrate or key not in known:
        origin = getattr(drafter, "forked_from", lambda: None)()  # a fork starts warm, on its own copy
        learned = _POLICIES.get(origin, {}).get(key) if origin is not None else None
        policy = copy.deepcopy(learned) if learned is not None and not recalibrate else fresh()
        if learned is None and not recalibrate:
            if not _load_learned(policy, policy_file(model, drafter, sampling)):  # an earlier process's
                paid = getattr(drafter, "paid_member", None)  # (a mixed drafter: its draft model's)
                if getattr(policy, "frees", None) is not None and paid is not None:
                    _load_learned(policy, policy_file(model, paid, sampling), sources=False)
        known[key] = policy
    return known[key]


def policy_file(model, drafter, sampling) -> Path:
    """Where what a policy learned is kept: per target (and its weights), drafter (its kind,
    weights and settings) and sampling mode."""
    mode = "greedy" if sampling is None or sampling.greedy else "sampled"
    return policy_dir() / f"{model_key(model)}-{weights_key(model)}-{_tag(drafter)}-{mode}.json"


def _tag(drafter) -> str:
    """A drafter's kind and what changes its acceptance: its weights (a draft model's, a head's)
    and settings (tree budget, lookup guidance, head share, stop rule, n-gram sizes); a mixed
    drafter's, each member's."""
    import mlx.nn as nn

    parent = getattr(drafter, "forked_from", lambda: None)() or drafter
    kind = type(parent).__name__
    members = getattr(parent, "drafters", None)
    if members is not None:
        return kind + "".join(f"-[{_tag(m)}]" for m in members)
    draft_model = getattr(parent, "model", None)
    if draft_model is not None:  # (another draft model's weights draft otherwise)
        kind += f"-{model_key(draft_model)}-{weights_key(draft_model)}"
    owners = (parent, getattr(parent, "context", None))  # (a block drafter keeps its net in its context)
    nets = [getattr(o, name) for o in owners for name in ("head", "net", "heads")
            if isinstance(getattr(o, name, None), nn.Module)]
    if nets:  # a head's own weights (a published head and its realigned copy learn apart)
        kind += "-" + hashlib.sha256("".join(map(weights_key, nets)).encode()).hexdigest()[:8]
    if getattr(parent, "tree_budget", None) is not None:  # trees learn apart from the same kind's chains
        kind += f"-tree{parent.tree_budget}"
    if getattr(parent, "lookup", True) is False:  # unguided chains draft at another cost
        kind += "-nolookup"
    head = getattr(parent, "head_vocab", short_head.HEAD_VOCAB)  # a draft head over another share
    if head != short_head.HEAD_VOCAB:
        kind += "-fullhead" if head is None else f"-head{head}"
    stop = getattr(parent, "min_confidence", MIN_CONFIDENCE)  # chains that stop elsewhere
    if stop != MIN_CONFIDENCE:
        kind += "-nostop" if stop is None else f"-stop{stop:g}"
    if hasattr(parent, "min_n"):  # prompt lookup: its n-gram sizes, branches and corpus
        from .drafters.ngram import NGramDrafter

        default = NGramDrafter()
        tag = [f"n{parent.min_n}-{parent.max_n}" if (parent.min_n, parent.max_n) != (default.min_n, default.max_n)
               else "", f"b{parent.branches}" if parent.branches != 1 else "",
               "c" + hashlib.sha256(repr(parent.corpus).encode()).hexdigest()[:6] if parent.corpus is not None else ""]
        kind += "".join(f"-{t}" for t in tag if t)
    return kind


def policy_dir() -> Path:
    return calibration.cache_dir() / "policies"


def tree_calibration_file(model, draft_model) -> Path:
    """Where what a draft model's probabilities are worth to a target (`dynamic_tree.Calibration`)
    is kept: per target and draft model, both with their weights."""
    return policy_dir() / (f"{model_key(model)}-{weights_key(model)}-calibration-"
                           f"{model_key(draft_model)}-{weights_key(draft_model)}.json")


def load_tree_calibration(model, draft_model):
    """A `dynamic_tree.Calibration` for this pair, started from an earlier process's when one was
    kept (absent or damaged: from the prior)."""
    from .dynamic_tree import Calibration

    cal = Calibration()
    try:
        cal.restore(json.loads(tree_calibration_file(model, draft_model).read_text()))
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return cal


def save_tree_calibration(cal, model, draft_model) -> None:
    """Keep a calibration that learned in this process for the next (never raises)."""
    if cal is not None and cal.learned:
        try:
            write_json(tree_calibration_file(model, draft_model), cal.state())
        except OSError:
            pass


def weights_key(model) -> str:
    """A fingerprint of the weights themselves (acceptance depends on them, unlike costs):
    a few values from the middle of every parameter tensor, read in one evaluation, once a model."""
    def make() -> list[str]:
        import mlx.core as mx
        from mlx.utils import tree_flatten

        flat = [v.reshape(-1) for _, v in tree_flatten(model.parameters())]
        parts = [v[v.size // 2 : v.size // 2 + 4].astype(mx.float32) for v in flat if v.size]
        probe = mx.concatenate(parts).tolist() if parts else []
        return [hashlib.sha256(json.dumps(probe).encode()).hexdigest()[:8]]

    return _WEIGHTS.setdefault(model, make)[0]


LEARNED = ("accept", "seen", "scale", "shape")
# How step times were taken (1, unversioned: the first plain step after a drafting step was
# timed with the next step's launch, making plain steps look dearer): older timings are dropped.
TIMING_VERSION = 2


def save_learned(policy: AdaptiveK, path: Path) -> None:
    """Keep what `policy` learned for the next process (never raises: it is only a warm start)."""
    try:
        write_json(path, _learned(policy))
    except OSError:
        pass


def _learned(policy: AdaptiveK) -> dict:
    data = {name: getattr(policy, name) for name in LEARNED}
    data["shape"] = {str(k): v for k, v in policy.shape.items()}
    data["timing"], data["curve"] = TIMING_VERSION, policy.costs.verify[0]
    if policy.shapes is not None:  # tokens per second each tree shape gave (`tree_shape.ShapeChoice`)
        data["tree_shapes"] = {str(k): v for k, v in policy.shapes.rate.items() if v is not None}
    if getattr(policy, "frees", None) is not None:  # `SourceChoice`: the free source's own
        data["frees"], data["free_share"] = [_learned(p) for p in policy.frees], policy.free_share
    return data


def _load_learned(policy: AdaptiveK, path: Path, sources: bool = True) -> bool:
    """Start `policy` from what was kept at `path`; False when nothing usable was there.
    `sources`: a `SourceChoice` takes only a file written by one (else its own part alone)."""
    try:
        _apply_learned(policy, json.loads(path.read_text()), sources)
        return True
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False  # absent or damaged (the policy starts cold: `_apply_learned` sets it last)


def _finite(value, low: float = 0.0) -> float:
    """A number a kept policy may hold: finite and above `low`, else the file is damaged."""
    value = float(value)
    if not (math.isfinite(value) and value > low):
        raise ValueError(f"not a usable number: {value}")
    return value


def _apply_learned(policy: AdaptiveK, data: dict, sources: bool = True) -> None:
    """Set `policy` from kept `data`: every value (the free sources' too) is read and checked
    before any is set, so a damaged file leaves the policy as it was (cold)."""
    _set_learned(policy, _read_learned(policy, data, sources))


def _read_learned(policy: AdaptiveK, data: dict, sources: bool = True) -> dict:
    frees = getattr(policy, "frees", None) if sources else None
    if frees is not None and len(data["frees"]) != len(frees):  # (older: both members merged)
        raise ValueError("not a source choice's")
    accept, seen = data["accept"], data["seen"]
    if any(len(t) != STATES or any(len(row) != policy.k_max for row in t) for t in (accept, seen)):
        raise ValueError("another draft limit, or damaged")  # start cold
    # Warm, but worth only a few observations, and never more pessimistic than a cold
    # start: another process's workload (chat) may differ from this one's (code edits),
    # and a policy that started parked would rarely look again within one request.
    if not all(math.isfinite(float(a)) and 0 <= float(a) <= 1 for row in accept for a in row) or not all(
            math.isfinite(float(n)) and float(n) >= 0 for row in seen for n in row):
        raise ValueError("acceptances outside 0..1 or counts not finite and >= 0")  # damaged: start cold
    carried = [[_carried(a, n) for a, n in zip(*rows)] for rows in zip(accept, seen)]
    out = {"accept": [[a for a, _ in row] for row in carried], "seen": [[n for _, n in row] for row in carried]}
    # Step times taken as this version takes them, against the same cost curve (one measured
    # again, `calibration.suspect`, makes what they were learned against another scale).
    if data.get("timing") == TIMING_VERSION and data.get("curve") == policy.costs.verify[0]:
        out["scale"] = None if data["scale"] is None else _finite(data["scale"])
        out["shape"] = {int(k): _finite(v) for k, v in data["shape"].items()}
        out["trees"] = {int(k): _finite(v, low=-math.inf) for k, v in (data.get("tree_shapes") or {}).items()}
    if frees is not None:
        out["free_share"] = min(max(_finite(data["free_share"], low=-math.inf), 0.0), 1.0)
        out["frees"] = [_read_learned(p, learned) for p, learned in zip(frees, data["frees"])]
    return out


def _set_learned(policy: AdaptiveK, v: dict) -> None:
    policy.accept, policy.seen = v["accept"], v["seen"]
    if "shape" in v:
        policy.scale, policy.shape = v["scale"], v["shape"]
        if v["trees"]:
            from .tree_shape import ShapeChoice

            policy.shapes = ShapeChoice.known(v["trees"])
    if "frees" in v:
        for p, learned in zip(policy.frees, v["frees"]):
            _set_learned(p, learned)
        policy.free_share = v["free_share"]


def hand_back(drafter) -> None:
    """A fork's learned policies become its origin's, so the next fork starts from them."""
    origin = getattr(drafter, "forked_from", lambda: None)()
    mine = _POLICIES.get(drafter)
    if origin is not None and mine:
        _POLICIES.setdefault(origin, dict).update(mine)
