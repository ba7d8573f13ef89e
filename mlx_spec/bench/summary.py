"""From run records to the numbers people compare: medians, spreads, ratios, checks.

Pure functions over the harness's records (dicts), so every rule here can be
tested on literal numbers. A speed-up is the ratio of a method's decode speed
to the baseline's on the same prompt in the same round, never a ratio of two
medians taken at different times; the median and the min-max spread are over
those paired ratios.
"""

from __future__ import annotations

import math
import random
import statistics

ALL = "all"  # the pseudo-suite that pools every prompt


def median(xs: list[float]) -> float | None:
    xs = [x for x in xs if x is not None and not math.isnan(x)]
    return statistics.median(xs) if xs else None


def spread(xs: list[float]) -> tuple[float, float] | None:
    """(min, max) of the finite values."""
    xs = [x for x in xs if x is not None and not math.isnan(x)]
    return (min(xs), max(xs)) if xs else None


def ratio(a: float | None, b: float | None) -> float | None:
    """a / b, or None when either is missing or b is zero."""
    if a is None or b is None or b == 0:
        return None
    return a / b


def first_difference(a: list[int], b: list[int]) -> int | None:
    """Index of the first token where the two outputs differ (None: identical)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _key(rec: dict) -> tuple:
    return rec["suite"], rec["prompt"], rec["repeat"]


def paired_speedups(records: list[dict], baseline: str,
                    field: str = "decode_tps") -> dict[str, list[tuple[str, float]]]:
    """method -> [(suite, `field` / the baseline's on the same prompt and round)]. `field`:
    "decode_tps" (after the first step) or "e2e_tps" (the whole request, prefill and any
    drafter's prompt read included, wherever the method does it)."""
    methods = dict.fromkeys(r["method"] for r in records)
    return {m: xs for m in methods if (xs := paired_between(records, m, baseline, field))}


def check_identical(records: list[dict], baseline: str) -> dict[str, dict]:
    """Per method: how many runs reproduced the baseline's tokens, and where others diverged."""
    base = {(r["suite"], r["prompt"]): r["tokens"] for r in records
            if r["method"] == baseline and r["repeat"] == 0}
    out: dict[str, dict] = {}
    for r in records:
        ref = base.get((r["suite"], r["prompt"]))
        if ref is None:
            continue
        entry = out.setdefault(r["method"], {"identical": 0, "runs": 0, "mismatches": []})
        entry["runs"] += 1
        at = first_difference(r["tokens"], ref)
        if at is None:
            entry["identical"] += 1
        else:
            entry["mismatches"].append({"suite": r["suite"], "prompt": r["prompt"],
                                        "repeat": r["repeat"], "first_difference": at})
    return out


def _pool(rows: list[dict], speedups: list[float], whole: list[float]) -> dict:
    """The metrics of one method on one suite (or on all of them)."""
    drafted = sum(r["drafted"] for r in rows)
    accepted = sum(r["accepted"] for r in rows)
    forwards = sum(r["forwards"] for r in rows)
    width = max((len(r["pos_drafted"]) for r in rows), default=0)
    pos_d = [sum(r["pos_drafted"][i] for r in rows if i < len(r["pos_drafted"])) for i in range(width)]
    pos_a = [sum(r["pos_accepted"][i] for r in rows if i < len(r["pos_accepted"])) for i in range(width)]
    return {
        "runs": len(rows),
        "decode_tps": median([r["decode_tps"] for r in rows]),
        "decode_tps_spread": spread([r["decode_tps"] for r in rows]),
        "speedup": median(speedups),
        "speedup_spread": spread(speedups),
        "tau": ratio(sum(r.get("step_tokens", r["accepted"] + r["forwards"]) for r in rows), forwards),
        "acceptance_rate": ratio(accepted, drafted),
        "accepted_per_position": [a / d for a, d in zip(pos_a, pos_d)],
        "prompt_tps": median([r["prompt_tps"] for r in rows]),
        "e2e_tps": median([r["e2e_tps"] for r in rows]),
        "e2e_speedup": median(whole),
        "peak_memory_gb": max((r["peak_memory_gb"] for r in rows), default=None),
    }


def paired_between(records: list[dict], a: str, b: str,
                   field: str = "decode_tps") -> list[tuple[str, float]]:
    """[(suite, a's `field` / b's on the same prompt and round)]: two methods head to head,
    without the baseline's own noise in between."""
    other = {_key(r): r.get(field) for r in records if r["method"] == b}
    return [(r["suite"], x) for r in records if r["method"] == a
            for x in [ratio(r.get(field), other.get(_key(r)))] if x is not None]


def median_interval(xs: list[float], level: float = 0.9, draws: int = 2000,
                    seed: int = 0) -> tuple[float, float] | None:
    """A percentile bootstrap interval for the median of `xs` (seeded, so a saved run
    always prints the same interval). With a handful of prompts it is wide, which is the
    point: it says how far one run's median can be trusted."""
    xs = [x for x in xs if x is not None and not math.isnan(x)]
    if not xs:
        return None
    rng = random.Random(seed)
    meds = sorted(statistics.median(rng.choices(xs, k=len(xs))) for _ in range(draws))
    cut = int((1 - level) / 2 * draws)
    return meds[cut], meds[draws - 1 - cut]


def head_to_head(records: list[dict], pairs: list[tuple[str, str]],
                 suites: list[str]) -> list[dict]:
    """For each (a, b) that both ran: per suite and pooled, the median paired ratio of a's
    speed to b's (decode and whole request) with its 90% bootstrap interval, and a verdict:
    "ahead"/"behind" when the interval leaves 1 out, else "level within noise"."""
    out = []
    for a, b in pairs:
        decode, whole = paired_between(records, a, b), paired_between(records, a, b, "e2e_tps")
        if not decode:
            continue
        per = {}
        for s in [*suites, ALL]:
            xs = [x for suite, x in decode if s in (ALL, suite)]
            if not xs:
                continue
            lo, hi = median_interval(xs)
            per[s] = {"pairs": len(xs), "ratio": median(xs), "interval": (lo, hi),
                      "verdict": "ahead" if lo > 1 else "behind" if hi < 1 else "level within noise",
                      "e2e_ratio": median([x for suite, x in whole if s in (ALL, suite)])}
        out.append({"a": a, "b": b, "suites": per})
    return out


def head_to_head_pairs(summary: dict) -> list[tuple[str, str]]:
    """The comparisons the issues' targets are about, among the methods that ran: our draft
    model (its best k) and the mixed drafter against mlx-lm's speculative decoding (its best
    k), the CLI's default with a draft model (`DEFAULT_WITH_DRAFT`) against its sources alone
    and against its own draft head over the whole vocabulary, and the mixed drafter against it and against prompt lookup."""
    ours, theirs = best_variant(summary, "draft"), best_variant(summary, "mlx-lm-draft")
    pairs = [(ours, theirs), (DEFAULT_WITH_DRAFT, theirs), *[(DEFAULT_WITH_DRAFT, m) for m in SOURCES],
             (DEFAULT_WITH_DRAFT, "draft-full-vocab@auto"),  # its draft head over part of the vocabulary
             (DEFAULT_WITH_DRAFT, "draft-no-stop@auto"),  # its chains ending at an unsure token
             ("mixed@auto", theirs), ("mixed@auto", "draft@auto"), ("mixed@auto", "ngram@auto")]
    return list(dict.fromkeys((a, b) for a, b in pairs if a in summary and b in summary and a != b))


def summarize(records: list[dict], baseline: str) -> dict[str, dict[str, dict]]:
    """method -> suite (and "all") -> metrics; methods and suites in first-seen order."""
    speedups = paired_speedups(records, baseline)
    whole = paired_speedups(records, baseline, "e2e_tps")
    methods = list(dict.fromkeys(r["method"] for r in records))
    suites = list(dict.fromkeys(r["suite"] for r in records))
    out: dict[str, dict[str, dict]] = {}
    for m in methods:
        out[m] = {}
        for s in [*suites, ALL]:
            rows = [r for r in records if r["method"] == m and s in (ALL, r["suite"])]
            sp = [x for suite, x in speedups.get(m, []) if s in (ALL, suite)]
            e2e = [x for suite, x in whole.get(m, []) if s in (ALL, suite)]
            if rows:
                out[m][s] = _pool(rows, sp, e2e)
    return out


def best_variant(summary: dict, method: str, suite: str = ALL) -> str | None:
    """The label of `method`'s variant (any k) with the highest median speed-up on `suite`."""
    found = [(v[suite]["speedup"], label) for label, v in summary.items()
             if label.split("@")[0] == method and suite in v and v[suite]["speedup"] is not None]
    return max(found)[1] if found else None


def _target(name: str, goal: str, value: float | None, met: bool | None, detail: str) -> dict:
    return {"name": name, "target": goal, "value": value, "met": met, "detail": detail}


def _paired_note(h2h: list[dict] | None, a: str, b: str, suite: str = ALL) -> str:
    """The detail's note on a against b on `suite` (their median paired ratio, its interval
    and verdict), or an empty string when that pair was not compared."""
    row = next((h["suites"].get(suite) for h in h2h or [] if (h["a"], h["b"]) == (a, b)), None)
    if row is None:
        return ""
    lo, hi = row["interval"]
    return f", head to head {row['ratio']:.2f}x of {b} [90%: {lo:.2f}-{hi:.2f}]: {row['verdict']}"


DEFAULT_WITH_DRAFT = "draft@auto"  # what `mlx-spec generate --draft-model D` runs: lookup-guided chains
SOURCES = ("ngram@auto", "draft-no-lookup@auto")  # its two sources alone: prompt lookup, the draft model


def _default_targets(summary: dict, theirs: str | None, h2h: list[dict] | None) -> list[dict]:
    """Issue #18's two for `mlx-spec generate --draft-model D` (the draft model, its chains
    guided by prompt lookup, under `auto`): >= 1.25x mlx-lm's speculative decoding at its best
    k, pooled; and on every suite at least the better of prompt lookup alone and the draft model
    alone (unguided) under `auto`, when both ran."""
    ours = summary.get(DEFAULT_WITH_DRAFT)
    if ours is None:
        return []
    out, name = [], DEFAULT_WITH_DRAFT
    if theirs:
        a, b = ours[ALL]["speedup"], summary[theirs][ALL]["speedup"]
        r = ratio(a, b)
        out.append(_target(f"{name} (the CLI's default with a draft model) vs mlx-lm's speculative "
                           "decoding at its best k", ">= 1.25x", r, r is not None and r >= 1.25,
                           f"{name} {a:.2f}x vs {theirs} {b:.2f}x over baseline"
                           + _paired_note(h2h, name, theirs) if r is not None
                           else "no data"))
    if all(m in summary for m in SOURCES):
        suites = [x for x in ours if x != ALL]
        best = {x: max(SOURCES, key=lambda m: summary[m].get(x, {}).get("speedup") or 0) for x in suites}
        short = [x for x in suites
                 if (ours[x]["speedup"] or 0) < (summary[best[x]].get(x, {}).get("speedup") or 0)]
        out.append(_target(f"{name} on every suite vs the better of {' and '.join(SOURCES)}",
                           "at least the better", f"{len(suites) - len(short)}/{len(suites)} suites",
                           not short, "behind on " + "; ".join(
                               x + _paired_note(h2h, name, best[x], x) for x in short)
                           if short else "ahead or level everywhere"))
    return out


def judge(records: list[dict], summary: dict, identical: dict, suites: list[str],
          greedy: bool) -> dict:
    """The result's `head_to_head` and `targets` (the targets' details use the former)."""
    h2h = head_to_head(records, head_to_head_pairs(summary), suites)
    return {"head_to_head": h2h, "targets": evaluate_targets(summary, identical, greedy, h2h)}


def evaluate_targets(summary: dict, identical: dict, greedy: bool,
                     h2h: list[dict] | None = None) -> list[dict]:
    """The issue's targets, each with its measured value and whether it was met.

    One n-gram configuration (the k best over all suites) must pass both of its
    targets; each speculative method competes at its own best k. A target is judged on
    the medians of speed-ups over the baseline; `h2h` (from `head_to_head`) adds the
    methods' own paired ratio and its interval to the detail, to tell a real shortfall
    from one within this run's noise.
    """
    out = []
    ours, theirs = best_variant(summary, "draft"), best_variant(summary, "mlx-lm-draft")
    if ours and theirs:
        a, b = summary[ours][ALL]["speedup"], summary[theirs][ALL]["speedup"]
        r = ratio(a, b)
        out.append(_target("draft model vs mlx-lm's speculative decoding (each at its best k)",
                           ">= 1.15x", r, r is not None and r >= 1.15,
                           f"{ours} {a:.2f}x vs {theirs} {b:.2f}x over baseline"
                           + _paired_note(h2h, ours, theirs)))
    out += _default_targets(summary, theirs, h2h)
    ng = best_variant(summary, "ngram")
    for suite, goal, op in (("code-edit", 1.4, "at least"), ("chat", 0.95, "never below")):
        if ng and suite in summary[ng]:
            s = summary[ng][suite]
            v, lo = s["speedup"], (s["speedup_spread"] or (None, None))[0]
            # "never below" is judged on the worst prompt, "at least" on the median.
            judged = lo if op == "never below" else v
            out.append(_target(f"n-gram on {suite} ({ng})", f"{op} {goal}x over baseline", v,
                               judged is not None and judged >= goal,
                               f"median {v:.2f}x, min {lo:.2f}x" if v is not None and lo is not None
                               else "no data"))
    if greedy:
        bad = {m: e for m, e in identical.items() if e["identical"] < e["runs"]}
        runs = sum(e["runs"] for e in identical.values())
        detail = "all runs identical" if not bad else "; ".join(
            f"{m}: {e['runs'] - e['identical']}/{e['runs']} differ (first at token "
            f"{e['mismatches'][0]['first_difference']} of {e['mismatches'][0]['suite']}/"
            f"{e['mismatches'][0]['prompt']})" for m, e in bad.items())
        out.append(_target("greedy output identical to baseline", "every method and prompt",
                           f"{runs - sum(e['runs'] - e['identical'] for e in bad.values())}/{runs} runs",
                           not bad, detail))
    return out
