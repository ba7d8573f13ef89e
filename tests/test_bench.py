"""The benchmark harness on tiny random models: plumbing, statistics and checks, no timing.

Benchmarks are scripts; nothing here asserts a speed. What is tested: the run
goes end to end and writes what the docs promise, the identical-output check
can fail, the statistics are right on literal numbers, BLAS detection parses
real /proc/self/maps lines, and the data files (suites, claims) are complete.
"""

from __future__ import annotations

import dataclasses
import json
import re
import sys

import pytest

import tiny
from mlx_spec import cli
from mlx_spec.bench import claims, cost, harness, hardware, methods, report, suites, summary

# --- end to end ---------------------------------------------------------------


@pytest.fixture
def tiny_models(monkeypatch):
    """`mlx-spec bench --model target --draft-model draft` resolves to tiny random models."""
    pair = {"target": (tiny.llama_model(seed=0), tiny.tokenizer()),
            "draft": (tiny.llama_model(seed=0, layers=1), tiny.tokenizer())}
    import mlx_spec

    monkeypatch.setattr(mlx_spec, "load", lambda name: pair[name])
    monkeypatch.setattr("mlx_spec.bench.cli.resolve_model", lambda name, dtype: name)
    return pair


def test_bench_end_to_end_on_tiny_models(tiny_models, tmp_path, capsys):
    out = tmp_path / "run"
    rc = cli.main(["bench", "--model", "target", "--draft-model", "draft", "--out", str(out),
                   "--max-tokens", "8", "--num-draft-tokens", "3", "--cost-repeats", "1",
                   "--cost-context", "16", "--claims"])
    assert rc == 0
    stdout = capsys.readouterr().out
    assert "| method |" in stdout and "### Per method and suite" in stdout
    assert "| whole request |" in stdout and "–x" not in stdout
    assert "Published claims" in stdout
    assert "### Head to head" in stdout and "| draft@3 vs mlx-lm-draft@" in stdout
    result = json.loads((out / "results.json").read_text())
    for key in ("schema", "command", "config", "hardware", "hardware_line", "verify_cost",
                "summary", "identical", "head_to_head", "targets", "skipped", "runs"):
        assert key in result, key
    assert result["config"]["suites"] == suites.suite_names()
    assert result["config"]["methods"] == ["baseline", "mlx-spec", "mlx-lm-draft@2",
                                           "mlx-lm-draft@3", "ngram@3", "draft@3"]
    assert "mlx-lm-draft@auto: not supported by mlx-lm" not in result["skipped"]
    assert len(result["runs"]) == 6 * len(suites.suite_names())  # 1 prompt per suite, 1 repeat
    assert len(result["verify_cost"]["relative"]) == 16
    for label, per in result["summary"].items():
        m = per[summary.ALL]
        for key in ("decode_tps", "speedup", "speedup_spread", "tau", "acceptance_rate",
                    "accepted_per_position", "prompt_tps", "peak_memory_gb"):
            assert key in m, (label, key)
    # Every greedy method reproduces mlx-lm's plain decoding, token for token.
    assert all(e["identical"] == e["runs"] for e in result["identical"].values())
    assert {"cpu", "memory_gb", "mlx_version", "mlx_device", "blas"} <= set(result["hardware"])


def test_preset_says_what_is_missing_and_exits_nonzero(capsys, monkeypatch):
    rc = cli.main(["bench", "--preset", "muse-glimmer-dflash"])
    err = capsys.readouterr().err
    assert rc != 0
    assert "Muse-Glimmer-30B-assistant" in err and "--drafter" in err
    # A preset whose drafter kind this mlx-spec lacks names that too.
    gone = dataclasses.replace(methods.METHODS["dflash"], unavailable=lambda: "no dflash here")
    monkeypatch.setitem(methods.METHODS, "dflash", gone)
    assert cli.main(["bench", "--preset", "muse-glimmer-dflash"]) != 0
    assert "no dflash here" in capsys.readouterr().err


def test_mixed_method_drafts_with_both_members_and_keeps_the_plain_output(tiny_models):
    from mlx_spec import DraftModelDrafter, MixedDrafter, NGramDrafter

    (model, tok), (draft, draft_tok) = tiny_models["target"], tiny_models["draft"]
    ctx = methods.Context(model=model, tokenizer=tok, draft_model=draft, draft_tokenizer=draft_tok)
    ids = [5, 9, 13, 5, 9, 13, 5, 9]
    plain = [r.token for r in methods.METHODS["baseline"].stream(ctx, ids, None, 12, None)]
    out = list(methods.METHODS["mixed"].stream(ctx, ids, 3, 12, None))
    assert [r.token for r in out] == plain
    (drafter,) = ctx.drafters.values()
    assert isinstance(drafter, MixedDrafter)
    assert [type(d) for d in drafter.drafters] == [NGramDrafter, DraftModelDrafter]
    assert sum(r.from_draft for r in out) > 0  # drafts were accepted, not just proposed


@pytest.mark.parametrize("temp, seeds", [(0.0, [None, None]), (0.7, [5, 6])])
def test_greedy_runs_are_unseeded_so_auto_keeps_what_it_learns(tiny_models, temp, seeds):
    """A seeded request gets a fresh `auto` policy (it must repeat); greedy runs repeat anyway,
    so the bench seeds only sampled runs (with the draft model on auto, seeded greedy runs
    never drafted: a fresh policy cannot repay the prompt read at its cautious prior)."""
    seen = []

    def recording(ctx, ids, k, max_tokens, seed):
        seen.append(seed)
        return methods.METHODS["baseline"].stream(ctx, ids, k, max_tokens, seed)

    model, tok = tiny_models["target"]
    ctx = methods.Context(model=model, tokenizer=tok, temp=temp)
    variant = methods.Variant(methods.Method("rec", "records its seed", recording))
    prompts = [suites.Prompt("chat", f"p{i}", f"w{5 + i} w9") for i in range(2)]
    harness.run_bench(ctx, [variant], prompts, max_tokens=2, seed=5, warmup=False, progress=lambda m: None)
    assert seen == seeds


def test_load_rebuilds_the_report_without_running(tiny_models, tmp_path, capsys):
    out = tmp_path / "run"
    cli.main(["bench", "--model", "target", "--methods", "baseline,ngram", "--suites", "chat",
              "--out", str(out), "--max-tokens", "4", "--cost-repeats", "0"])
    first = capsys.readouterr().out
    assert cli.main(["bench", "--load", str(out / "results.json")]) == 0
    assert capsys.readouterr().out == first


def test_load_judges_saved_runs_by_this_versions_rules(tiny_models, tmp_path, capsys):
    """A results.json from an older mlx-spec, without the head-to-head table or with targets
    judged by older rules, is judged again from its run records."""
    out = tmp_path / "run"
    cli.main(["bench", "--model", "target", "--draft-model", "draft", "--methods",
              "baseline,draft,mlx-lm-draft", "--suites", "chat", "--num-draft-tokens", "2",
              "--out", str(out), "--max-tokens", "4", "--cost-repeats", "0"])
    first = capsys.readouterr().out
    assert "### Head to head" in first and "| draft@2 vs mlx-lm-draft@2 |" in first
    saved = json.loads((out / "results.json").read_text())
    old = {k: v for k, v in saved.items() if k != "head_to_head"}  # as an older mlx-spec wrote it
    old["targets"] = summary.evaluate_targets(saved["summary"], saved["identical"], greedy=True)
    (out / "old.json").write_text(json.dumps(old))
    assert cli.main(["bench", "--load", str(out / "old.json")]) == 0
    assert capsys.readouterr().out == first
    stale = {**saved, "head_to_head": [], "targets": [{**t, "met": not t["met"]} for t in saved["targets"]]}
    (out / "stale.json").write_text(json.dumps(stale))
    assert cli.main(["bench", "--load", str(out / "stale.json")]) == 0
    assert capsys.readouterr().out == first


# --- the identical-output check ---------------------------------------------


def _corrupting(ctx, ids, k, max_tokens, seed):
    """Plain decoding that changes the third token: a lossy 'method'."""
    for i, r in enumerate(methods.METHODS["baseline"].stream(ctx, ids, k, max_tokens, seed)):
        if i == 2:
            r.token = r.token + 1
        yield r


def test_identical_check_catches_a_method_that_changes_the_output():
    table = {**methods.METHODS, "lossy": methods.Method("lossy", "changes token 2", _corrupting)}
    ctx = methods.Context(tiny.llama_model(), tiny.tokenizer())
    plan = methods.plan_variants(["baseline", "lossy", "mlx-spec"], [2], ctx, table)
    prompts = suites.load_prompts(["chat"], 1)
    records = harness.run_bench(ctx, plan.variants, prompts, max_tokens=6, warmup=False,
                                progress=lambda m: None)
    ident = summary.check_identical(records, "baseline")
    assert ident["mlx-spec"]["identical"] == 1
    assert ident["lossy"]["identical"] == 0
    assert ident["lossy"]["mismatches"][0]["first_difference"] == 2
    target = summary.evaluate_targets(summary.summarize(records, "baseline"), ident, greedy=True)[-1]
    assert target["met"] is False and "lossy" in target["detail"]


# --- statistics on literal numbers -------------------------------------------


def test_median_spread_ratio():
    assert summary.median([3.0, 1.0, 2.0]) == 2.0
    assert summary.median([4.0, 1.0, 2.0, 3.0]) == 2.5
    assert summary.median([None, 5.0, float("nan")]) == 5.0
    assert summary.median([]) is None
    assert summary.spread([2.0, 0.5, 1.5]) == (0.5, 2.0)
    assert summary.spread([None]) is None
    assert summary.ratio(3.0, 2.0) == 1.5
    assert summary.ratio(1.0, 0.0) is None and summary.ratio(None, 1.0) is None


def test_first_difference():
    assert summary.first_difference([1, 2, 3], [1, 2, 3]) is None
    assert summary.first_difference([1, 9, 3], [1, 2, 3]) == 1
    assert summary.first_difference([1, 2], [1, 2, 3]) == 2


def _rec(method, suite, prompt, tps, **kw):
    base = {"method": method, "suite": suite, "prompt": prompt, "repeat": 0, "decode_tps": tps,
            "prompt_tps": 100.0, "e2e_tps": tps, "peak_memory_gb": 1.0, "tokens": [1, 2],
            "forwards": 10, "drafted": 0, "accepted": 0, "pos_drafted": [], "pos_accepted": []}
    return {**base, **kw}


def test_speedups_are_paired_per_prompt_then_pooled():
    records = [
        _rec("baseline", "a", "p1", 10.0), _rec("x", "a", "p1", 15.0),
        _rec("baseline", "a", "p2", 20.0), _rec("x", "a", "p2", 20.0),
        _rec("baseline", "b", "p3", 5.0),
        _rec("x", "b", "p3", 10.0, forwards=4, drafted=8, accepted=6,
             pos_drafted=[4, 4], pos_accepted=[4, 2]),
    ]
    records[3]["e2e_tps"] = 10.0  # p2's whole request: half the baseline's (e.g. a late prompt read)
    s = summary.summarize(records, "baseline")
    assert s["x"]["a"]["speedup"] == pytest.approx(1.25)  # median of 1.5 and 1.0
    assert s["x"]["a"]["e2e_speedup"] == pytest.approx(1.0)  # median of 1.5 and 0.5, paired too
    assert s["x"]["a"]["speedup_spread"] == (1.0, 1.5)
    assert s["x"]["a"]["decode_tps"] == pytest.approx(17.5)
    assert s["x"]["all"]["speedup"] == pytest.approx(1.5)  # median of 1.5, 1.0, 2.0
    assert s["x"]["b"]["tau"] == pytest.approx(2.5)  # (6 + 4) / 4
    assert s["x"]["b"]["acceptance_rate"] == pytest.approx(0.75)
    assert s["x"]["b"]["accepted_per_position"] == [1.0, 0.5]
    assert summary.best_variant({"x@2": {"all": {"speedup": 1.1}}, "x@4": {"all": {"speedup": 1.3}},
                                 "y@9": {"all": {"speedup": 5.0}}}, "x") == "x@4"


def test_head_to_head_pairs_two_methods_on_the_same_prompt_and_gives_an_honest_interval():
    def runs(method, suite, speeds):
        return [_rec(method, suite, f"{suite}{i}", x) for i, x in enumerate(speeds)]

    # b is the same on every prompt; a's ratio to it is 1.2-1.3 on "fast", 0.8-0.9 on
    # "slow", and 0.9-1.1 on "mixed" (one prompt each side of level).
    b = [10.0] * 5
    records = (runs("b", "fast", b[:4]) + runs("a", "fast", [12.0, 13.0, 12.5, 12.2])
               + runs("b", "slow", b[:3]) + runs("a", "slow", [8.0, 9.0, 8.5])
               + runs("b", "mixed", b) + runs("a", "mixed", [9.0, 11.0, 10.0, 9.5, 10.5]))
    records.append(_rec("a", "fast", "unpaired", 99.0))  # no b run on that prompt: left out
    assert sorted(x for s, x in summary.paired_between(records, "a", "b") if s == "slow") == \
        pytest.approx([0.8, 0.85, 0.9])
    (h,) = summary.head_to_head(records, [("a", "b"), ("a", "missing")], ["fast", "slow", "mixed"])
    assert (h["a"], h["b"]) == ("a", "b")
    fast, slow, mixed, pooled = (h["suites"][s] for s in ("fast", "slow", "mixed", summary.ALL))
    assert fast["pairs"] == 4 and fast["ratio"] == pytest.approx(1.235) and fast["verdict"] == "ahead"
    assert slow["ratio"] == pytest.approx(0.85) and slow["verdict"] == "behind"
    assert mixed["ratio"] == pytest.approx(1.0) and mixed["verdict"] == "level within noise"
    assert pooled["pairs"] == 12
    for c in (fast, slow, mixed, pooled):  # the interval holds the median, inside the data
        lo, hi = c["interval"]
        assert lo <= c["ratio"] <= hi
    assert 0.8 <= slow["interval"][0] < slow["interval"][1] <= 0.9
    assert mixed["interval"][0] < 1 < mixed["interval"][1]
    # Seeded: the same records always give the same interval; one value gives a point.
    assert summary.median_interval([0.9, 1.1, 1.0, 0.95]) == summary.median_interval([0.9, 1.1, 1.0, 0.95])
    assert summary.median_interval([1.3]) == (1.3, 1.3) and summary.median_interval([]) is None


def test_steps_rebuilt_from_mlx_lm_flags():
    # k=3, max 9: [T T F] [F] [T T T F] then a block cut short by max_tokens: [T]
    flags = [True, True, False, False, True, True, True, False, True]
    steps = harness.steps_from_flags(flags, k=3, max_tokens=9)
    assert steps == [(3, 2), (3, 0), (3, 3), (1, 1)]
    acc = harness.acceptance(steps)
    assert acc["forwards"] == 4 and acc["drafted"] == 10 and acc["accepted"] == 6
    assert acc["pos_drafted"] == [4, 3, 3] and acc["pos_accepted"] == [3, 2, 1]


def test_tau_counts_no_target_token_after_a_block_cut_at_a_drafted_eos():
    """mlx-lm, k = 3: [T T F] then a block whose second draft was the EOS: [T T] and no token of
    the target's after it. 5 tokens in 2 verify steps: tau 2.5 (3.0 counted the missing one)."""
    R = dataclasses.make_dataclass("R", ["token", "from_draft"])
    flags = [True, True, False, True, True]
    m = methods.Method("m", "", lambda ctx, ids, k, max_tokens, seed: (R(i, f) for i, f in enumerate(flags)))
    rec = harness.run_once(methods.Variant(m, 3), None, [1, 2], 9, None)
    assert (rec["step_tokens"], rec["forwards"], rec["accepted"]) == (5, 2, 4)
    assert summary._pool([rec], [1.0], [1.0])["tau"] == pytest.approx(2.5)


def test_decode_clock_starts_where_each_engine_ends_its_first_verify(monkeypatch):
    """mlx-lm yields the prompt's token with its first verified block; mlx-spec yields it
    first, alone. Both are timed from the end of their first verify, not from the first token."""
    now = [0.0]
    monkeypatch.setattr(harness.time, "perf_counter", lambda: now[0])
    R = dataclasses.make_dataclass("R", ["token", "from_draft", "stats"])
    traced = type("S", (), {"trace": [], "step_tokens": 0})()

    def stream_of(events, stats):  # (seconds before this token, drafted?)
        def stream(ctx, ids, k, max_tokens, seed):
            for i, (wait, drafted) in enumerate(events):
                now[0] += wait
                yield R(i, drafted, stats)
        return stream

    # mlx-lm: prompt + first verify (3 s) yields 3 drafted tokens and the target's; then 5 more
    lm = [(3.0, True), (0, True), (0, True), (0, False)] + [(1.0, False)] * 5
    # mlx-spec: the prompt's token at 2 s, then its first verify's 3 drafted + 1 at 4 s, 5 more
    ours = [(2.0, False), (2.0, True), (0, True), (0, True), (0, False)] + [(1.0, False)] * 5
    for events, stats in ((lm, None), (ours, traced)):
        m = methods.Method("m", "", stream_of(events, stats))
        rec = harness.run_once(methods.Variant(m, 4 if stats is None else None), None, [1, 2], 9, None)
        first_verify_end = 3.0 if stats is None else 4.0
        assert rec["decode_tps"] == pytest.approx(5 / (rec["total_s"] - first_verify_end))
        now[0] = 0.0
    assert rec["ttft_s"] == pytest.approx(2.0)


def test_targets_on_literal_summary():
    def m(sp, lo=None):
        return {"speedup": sp, "speedup_spread": (lo if lo is not None else sp, sp)}

    s = {"draft@4": {"all": m(1.5)}, "mlx-lm-draft@2": {"all": m(1.2)},
         "ngram@4": {"all": m(1.2), "code-edit": m(1.6, 1.45), "chat": m(1.0, 0.9)}}
    t = {x["name"].split(" (")[0]: x for x in summary.evaluate_targets(s, {}, greedy=False)}
    assert t["draft model vs mlx-lm's speculative decoding"]["value"] == pytest.approx(1.25)
    assert t["draft model vs mlx-lm's speculative decoding"]["met"]
    assert t["n-gram on code-edit"]["met"]
    assert not t["n-gram on chat"]["met"]  # one chat prompt fell to 0.9x
    every_name = "draft@auto on every suite vs the better of ngram@auto and draft-no-lookup@auto"
    assert every_name not in t  # not run

    s.update({"draft@auto": {"all": m(1.6), "code-edit": m(2.0), "chat": m(1.2)},
              "ngram@auto": {"all": m(1.1), "code-edit": m(2.2), "chat": m(1.0)},
              "draft-no-lookup@auto": {"all": m(1.5), "code-edit": m(1.5), "chat": m(1.2)}})
    t = {x["name"]: x for x in summary.evaluate_targets(s, {}, greedy=False)}
    vs_mlx_lm = t["draft@auto (the CLI's default with a draft model) vs mlx-lm's speculative decoding at its best k"]
    assert vs_mlx_lm["value"] == pytest.approx(1.6 / 1.2) and vs_mlx_lm["met"]
    every = t[every_name]
    assert not every["met"] and every["value"] == "1/2 suites" and every["detail"] == "behind on code-edit"
    # With the paired comparison, the detail says whether a shortfall is beyond the noise.
    h2h = [{"a": "draft@auto", "b": "ngram@auto",
            "suites": {"code-edit": {"ratio": 0.93, "interval": (0.85, 1.04), "verdict": "level within noise"}}},
           {"a": "draft@auto", "b": "mlx-lm-draft@2",
            "suites": {"all": {"ratio": 1.31, "interval": (1.2, 1.4), "verdict": "ahead"}}}]
    t = {x["name"]: x for x in summary.evaluate_targets(s, {}, greedy=False, h2h=h2h)}
    every = t[every_name]
    assert not every["met"]  # judged on the medians still
    assert every["detail"] == ("behind on code-edit, head to head 0.93x of ngram@auto "
                               "[90%: 0.85-1.04]: level within noise")
    assert t[next(n for n in t if n.startswith("draft@auto (the CLI"))]["detail"].endswith(
        "head to head 1.31x of mlx-lm-draft@2 [90%: 1.20-1.40]: ahead")
    s["draft@auto"]["code-edit"] = m(2.2)  # level with lookup alone: enough
    t = {x["name"]: x for x in summary.evaluate_targets(s, {}, greedy=False)}
    assert t[every_name]["met"]


def test_head_to_head_pairs_put_the_default_against_its_sources_and_mlx_lm():
    m = {"all": {"speedup": 1.0}}
    s = {k: m for k in ("baseline", "mlx-lm-draft@2", "mlx-lm-draft@4", "draft@auto", "draft-no-lookup@auto",
                        "ngram@auto", "mixed@auto")}
    s["mlx-lm-draft@4"] = {"all": {"speedup": 1.5}}
    assert summary.head_to_head_pairs(s) == [
        ("draft@auto", "mlx-lm-draft@4"), ("draft@auto", "ngram@auto"), ("draft@auto", "draft-no-lookup@auto"),
        ("mixed@auto", "mlx-lm-draft@4"), ("mixed@auto", "draft@auto"), ("mixed@auto", "ngram@auto")]
    s["draft-full-vocab@auto"] = m  # the default against its draft head over the whole vocabulary
    assert ("draft@auto", "draft-full-vocab@auto") in summary.head_to_head_pairs(s)


# --- hardware -----------------------------------------------------------------

MAPS_REFERENCE = """\
7f1c2a000000-7f1c2a01c000 r--p 00000000 08:01 1311 /work/venv/lib/python3.11/site-packages/mlx_cpu.libs/libblas-bd8a282c.so.3.10.0
7f1c2a01c000-7f1c2a0d2000 r-xp 0001c000 08:01 1311 /work/venv/lib/python3.11/site-packages/mlx_cpu.libs/libblas-bd8a282c.so.3.10.0
7f1c2b000000-7f1c2b400000 r-xp 00000000 08:01 1400 /work/venv/lib/python3.11/site-packages/numpy.libs/libscipy_openblas64_-32a4b2a6.so
7f1c2c000000-7f1c2c021000 rw-p 00000000 00:00 0
7ffd6a4e1000-7ffd6a502000 rw-p 00000000 00:00 0                          [stack]
"""
MAPS_OPENBLAS = """\
7f00aa000000-7f00aa004000 r--p 00000000 08:01 77 /usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3
7f00ab000000-7f00ab9f0000 r-xp 00000000 08:01 78 /usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblasp-r0.3.21.so
""" + MAPS_REFERENCE


def test_blas_detection_from_proc_maps():
    ref = hardware.detect_blas(MAPS_REFERENCE)
    assert ref["slow"] and "reference" in ref["name"]
    assert not any("scipy_openblas" in p for p in ref["paths"])  # numpy's private copy
    fast = hardware.detect_blas(MAPS_OPENBLAS)
    assert fast["name"] == "OpenBLAS" and not fast["slow"]
    assert hardware.detect_blas("")["name"] == "none found"


def test_busy_machine_warning():
    assert hardware.busy_warning([1.9, 2.4], 2) is None
    assert "busy" in hardware.busy_warning([2.0, 9.3], 2)
    assert hardware.busy_warning([None], 2) is None


def test_hardware_info_has_the_documented_fields():
    info = hardware.hardware_info()
    assert info["mlx_version"] and info["mlx_device"]
    assert "MLX" in hardware.describe(info)


# --- data files ---------------------------------------------------------------


def test_suites_load_with_at_least_eight_prompts_each():
    names = suites.suite_names()
    assert set(suites.SUITE_ORDER) <= set(names)
    for name in names:
        prompts = suites.load_suite(name)
        assert len(prompts) >= 8, name
        assert len({p.id for p in prompts}) == len(prompts)
        assert all(p.text.strip() for p in prompts)
    assert len(suites.load_prompts(names, 2)) == 2 * len(names)
    with pytest.raises(ValueError, match="unknown suite"):
        suites.load_suite("nope")


def test_encode_chat_falls_back_to_plain_text_without_a_template():
    tok = tiny.tokenizer()
    assert suites.encode_chat(tok, "w3 w4") == tok.encode("w3 w4")


def test_claims_file_and_presets():
    found = claims.load_claims()
    ids = {c["id"] for c in found}
    assert len(ids) == len(found)
    for c in found:
        assert c["speedup"] > 0 and c["source"]
        if c.get("baseline_tps") and c.get("spec_tps"):
            assert c["spec_tps"] / c["baseline_tps"] == pytest.approx(c["speedup"], rel=0.02)
    muse = {c["hardware"]: c for c in found if c["id"].startswith("muse-glimmer-dflash")}
    assert (muse["Apple M4 Max"]["baseline_tps"], muse["Apple M4 Max"]["spec_tps"]) == (23.7, 37.8)
    assert muse["NVIDIA RTX 5090"]["spec_tps"] == 233.4
    assert any(c["speedup"] == 1.82 and "M3 Max" in c["hardware"] for c in found)
    for p in claims.PRESETS.values():
        assert set(p.claims) <= ids, p.name
        assert set(p.methods) <= set(methods.METHODS), p.name


def test_claims_compare_beside_this_run():
    result = {"summary": {"baseline": {"all": {"speedup": 1.0}},
                          "draft@4": {"all": {"speedup": 1.5}}, "draft@2": {"all": {"speedup": 1.3}}},
              "hardware": {"cpu": "Apple M4 Max", "gpu": None, "platform": "Darwin arm64"},
              "hardware_line": "here"}
    rows = claims.compare(result, [
        {"id": "a", "hardware": "Apple M4 Max", "compare_with": ["draft", "mlx-lm-draft"]},
        {"id": "b", "hardware": "x", "compare_with": "dflash", "match": {"platform": "Linux x86_64"}},
    ])
    assert rows[0]["measured"] == [("draft@4", 1.5)] and rows[0]["same_hardware"]
    assert rows[1]["measured"] == [] and not rows[1]["same_hardware"]


# --- method table, cost curve, chart ------------------------------------------


def test_plan_variants_sweeps_k_and_skips_what_cannot_run():
    ctx = methods.Context(model=None, tokenizer=None)
    plan = methods.plan_variants(["ngram", "mlx-lm-draft", "draft"], [4, "auto"], ctx)
    assert [v.label for v in plan.variants] == ["baseline", "ngram@4", "ngram@auto"]
    assert any(s.startswith("mlx-lm-draft: needs --draft-model") for s in plan.skipped)
    ctx.draft_model = object()
    plan = methods.plan_variants(["mlx-lm-draft"], [4, "auto"], ctx)
    assert [v.label for v in plan.variants] == ["baseline", "mlx-lm-draft@2", "mlx-lm-draft@4"]
    assert "mlx-lm-draft@auto: not supported by mlx-lm" in plan.skipped
    with pytest.raises(ValueError, match="unknown method"):
        methods.plan_variants(["warp-drive"], [4], ctx)
    with pytest.raises(ValueError, match="unknown method"):
        methods.plan_variants(["warp-drive@4"], [4], ctx)


def test_a_method_can_fix_its_own_draft_lengths():
    ctx = methods.Context(model=None, tokenizer=None, draft_model=object())
    plan = methods.plan_variants(["mlx-lm-draft@4", "draft@auto", "ngram@2", "ngram@auto", "mixed"],
                                 [8, "auto"], ctx)
    assert [v.label for v in plan.variants] == ["baseline", "mlx-lm-draft@2", "mlx-lm-draft@4", "draft@auto",
                                                "ngram@2", "ngram@auto", "mixed@8", "mixed@auto"]
    plan = methods.plan_variants(["mlx-lm-draft@auto"], [4], ctx)
    assert [v.label for v in plan.variants] == ["baseline", "mlx-lm-draft@2"]
    assert plan.skipped == ["mlx-lm-draft@auto: not supported by mlx-lm"]


def test_verify_cost_curve_shape():
    curve = cost.verify_cost_curve(tiny.llama_model(), n_max=5, context=12, repeats=1)
    assert len(curve) == 5 and curve[0] == 1.0 and all(x > 0 for x in curve)
    assert cost.relative([2.0, 3.0, 5.0]) == [1.0, 1.5, 2.5]


def test_chart_is_skipped_with_a_hint_without_matplotlib(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import now raises ImportError
    why = report.chart({}, tmp_path / "c.png")
    assert "skipped" in why and "pip install" in why
    assert not (tmp_path / "c.png").exists()


@pytest.mark.parametrize("flags, message", [
    (["--methods", "baseline,foo"], "unknown method 'foo'"),
    (["--methods", "ngram@x"], "--methods ngram@x: K must be 1..16 or auto"),
    (["--methods", "ngram@0"], "K must be 1..16 or auto"),
    (["--num-draft-tokens", "2,x"], r"--num-draft-tokens \['x'\]"),
    (["--suites", "nosuch"], r"--suites \['nosuch'\]"),
    (["--prompts-per-suite", "-1"], "--prompts-per-suite must be at least 0"),
    (["--repeats", "0"], "--repeats must be at least 1"),
    (["--load", "missing.json"], "--load missing.json: no such file"),
    (["--drafter", "."], "--drafter .: name the method that runs it"),
    (["--out", __file__], r"--out .* is a file; the results go in a folder"),  # (found after the run)
    (["--out", __file__ + "/sub"], r"--out .*/sub: cannot make the results folder there \(.* is a file\)"),
    (["--suites", "chat, chat"], "a suite is named twice"),  # (paired each run with the other round's baseline)
])
def test_bad_bench_flags_get_one_error_line_before_any_model_is_loaded(flags, message, capsys, monkeypatch):
    monkeypatch.setattr("mlx_spec.bench.cli._measure", lambda args: pytest.fail("a model was loaded"))
    assert cli.main(["bench", "--model", "no-such-model", *flags]) == 2
    err = capsys.readouterr().err
    assert re.search(message, err) and "Traceback" not in err, err


def test_a_cost_context_of_zero_is_refused_by_argparse(capsys, monkeypatch):
    monkeypatch.setattr("mlx_spec.bench.cli._measure", lambda args: pytest.fail("a model was loaded"))
    with pytest.raises(SystemExit):  # (it failed after the model loaded, naming no flag)
        cli.main(["bench", "--model", "no-such-model", "--cost-context", "0"])
    assert "--cost-context: expected an integer >= 1" in capsys.readouterr().err


def test_a_drafter_gets_its_heads_method_and_a_bare_name_keeps_its_sweep(tmp_path):
    from mlx_spec.bench import cli as bench_cli

    (tmp_path / "config.json").write_text(json.dumps({"mlx_spec": {"drafter": "eagle3"}}))
    args = cli.build_parser(["bench"]).parse_args(["bench", "--drafter", str(tmp_path), "--methods", "baseline, ngram"])
    args.num_draft_tokens = "2,auto"
    bench_cli._check(args)
    assert args.methods == "baseline,ngram,eagle3"
    args = cli.build_parser(["bench"]).parse_args(["bench", "--suites", " chat , code-edit", "--methods", "ngram"])
    args.num_draft_tokens = "2"
    bench_cli._check(args)  # (the run read ' code-edit' as a suite name and failed after the model loaded)
    assert args.suites == "chat,code-edit"
    ctx = methods.Context(model=None, tokenizer=None)
    plan = methods.plan_variants(["baseline", "ngram@8", "ngram"], [2, "auto"], ctx)
    assert [v.label for v in plan.variants] == ["baseline", "ngram@2", "ngram@auto", "ngram@8"]


def test_sampling_out_of_range_and_a_draft_model_of_another_vocabulary_get_one_error_line(capsys, monkeypatch):
    """--temp -1 used to fail after the warm-ups, and a draft model that cannot draft for the
    target with a traceback."""
    import mlx_spec

    with pytest.raises(SystemExit):
        cli.main(["bench", "--model", "no-such-model", "--temp", "-1"])
    assert "--temp: expected a number >= 0, got '-1'" in capsys.readouterr().err
    pair = {"target": (tiny.llama_model(seed=0), tiny.tokenizer()),
            "draft": (tiny.llama_model(seed=0, layers=1, vocab=2 * tiny.VOCAB), tiny.tokenizer(2 * tiny.VOCAB))}
    monkeypatch.setattr(mlx_spec, "load", lambda name: pair[name])
    monkeypatch.setattr("mlx_spec.bench.cli.resolve_model", lambda name, dtype: name)
    assert cli.main(["bench", "--model", "target", "--draft-model", "draft", "--methods", "baseline,draft",
                     "--suites", "chat", "--max-tokens", "4", "--num-draft-tokens", "2", "--cost-repeats", "0",
                     "--out", "unused"]) == 2
    err = capsys.readouterr().err
    assert "error: " in err and "vocabular" in err and "Traceback" not in err, err
