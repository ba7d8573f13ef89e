"""`mlx-spec bench`: flags, presets, and the run from loading models to the report.

Only argparse at import time: the CLI builds its parser from this module, and
mlx / mlx-lm / matplotlib load inside `run`.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
from pathlib import Path

from ..generate_cli import add_dist_timeout, ranged

DEFAULTS = {  # sized so the default run on SmolLM2-135M takes a few minutes on a CPU
    "model": "smollm2-135m-instruct",
    "methods": "baseline,mlx-spec,mlx-lm-draft,ngram,draft",
    "num_draft_tokens": "2,4,auto",
    "suites": None,  # all
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help=f"target: model folder, zoo name or HF repo (default {DEFAULTS['model']})")
    p.add_argument("--draft-model", help="draft model for mlx-lm-draft and draft (folder, zoo name, repo)")
    p.add_argument("--drafter", help="head drafter folder for the mtp/eagle/eagle3/dflash/dspark methods")
    p.add_argument("--dtype", default="float32",
                   help="dtype of zoo models (default float32, the fast one on CPUs; bfloat16 on Macs)")
    p.add_argument("--methods", help=f"comma list (default {DEFAULTS['methods']}; NAME@K runs a method at K "
                   "alone, e.g. draft@auto,mlx-lm-draft@4; methods whose "
                   "models are not given are skipped; 'baseline' is always run)")
    p.add_argument("--suites", help="comma list of prompt suites (default: all)")
    p.add_argument("--num-draft-tokens", help="comma list of draft lengths to sweep, e.g. 2,4,auto "
                   f"(default {DEFAULTS['num_draft_tokens']}; mlx-lm-draft also always runs at its default 2)")
    p.add_argument("--max-tokens", type=int, default=64, help="new tokens per run (default 64)")
    p.add_argument("--repeats", type=int, default=1, help="timed rounds over all prompts (default 1)")
    p.add_argument("--prompts-per-suite", type=int, default=1,
                   help="first N prompts of each suite (default 1; 0 = all)")
    p.add_argument("--temp", type=ranged(float, 0), default=0.0, help="sampling temperature (default 0: greedy)")
    p.add_argument("--top-p", type=ranged(float, 0, 1), default=1.0)
    p.add_argument("--top-k", type=ranged(int, 0), default=0)
    p.add_argument("--min-p", type=ranged(float, 0, 1), default=0.0)
    p.add_argument("--seed", type=int, default=0, help="sampling seed (same for every method; greedy runs are unseeded)")
    p.add_argument("--cost-repeats", type=ranged(int, 0), default=3,
                   help="timed passes for the verify cost curve (0 skips it)")
    p.add_argument("--cost-context", type=ranged(int, 1), default=256, help="cache length behind the verify blocks")
    p.add_argument("--out", default="bench-results", help="folder for results.json and chart.png")
    p.add_argument("--preset", help="reproduce a claim's configuration; --list-presets shows them")
    p.add_argument("--list-presets", action="store_true", help="list presets and claims, then exit")
    p.add_argument("--claims", action="store_true", help="print published claims next to the measurements")
    p.add_argument("--shard", choices=("pipeline", "tensor"), default=None,
                   help="split the target over the ranks of `mlx-spec launch` (rank 0 reports)")
    add_dist_timeout(p)
    p.add_argument("--load", metavar="JSON", help="rebuild the report from a saved results.json; no run")


def run(args: argparse.Namespace) -> int:
    from . import claims as claims_mod

    if args.list_presets:
        _list_presets()
        return 0
    if args.load:
        if not Path(args.load).is_file():
            print(f"error: --load {args.load}: no such file (a results.json a bench run saved)", file=sys.stderr)
            return 2
        result = _judged(json.loads(Path(args.load).read_text()))
        return _report(result, args, Path(args.out) if args.out != "bench-results" else Path(args.load).parent)
    if args.preset:
        preset = claims_mod.PRESETS.get(args.preset)
        if preset is None:
            print(f"unknown preset {args.preset!r}; known: {', '.join(claims_mod.PRESETS)}", file=sys.stderr)
            return 2
        missing = claims_mod.missing_for(preset, args.model, args.drafter, args.draft_model)
        if missing:
            print(f"preset {preset.name} ({preset.summary}) cannot run here. Missing:", file=sys.stderr)
            for m in missing:
                print(f"  - {m}", file=sys.stderr)
            return 2
        _apply_preset(args, preset)
    for key, value in DEFAULTS.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    try:
        _check(args)  # before any model is loaded
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        result = _measure(args)
    except ValueError as e:  # a drafter that cannot draft for this target (vocabulary, shapes)
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.shard is None:
        return _report(result, args, Path(args.out))
    from ..distributed import barrier

    rc = 0 if result is None else _report(result, args, Path(args.out))  # rank 0 reports
    barrier()  # the ranks end together (a peer's closed socket is noisy in the ring backend)
    return rc


HEADS = ("mtp", "eagle", "eagle3", "dflash", "dspark")  # the methods that run --drafter


def _check(args) -> None:
    """Methods, draft lengths, suites and counts the run can use, else a ValueError naming the
    flag; a --drafter without a head method gets its kind's method (from its config)."""
    from mlx_spec.cache import MAX_DRAFT

    from .methods import METHODS
    from .suites import suite_names

    names = [n.strip() for n in args.methods.split(",") if n.strip()]
    for n in names:
        name, at, k = n.partition("@")
        if name not in METHODS:
            raise ValueError(f"--methods: unknown method {name!r}; known: {', '.join(METHODS)}")
        if at and not _draft_length(k):
            raise ValueError(f"--methods {n}: K must be 1..{MAX_DRAFT} or auto")
    bad = [k for k in args.num_draft_tokens.split(",") if not _draft_length(k.strip())]
    if bad:
        raise ValueError(f"--num-draft-tokens {bad}: each must be 1..{MAX_DRAFT} or auto")
    suites = [s.strip() for s in args.suites.split(",") if s.strip()] if args.suites else []
    unknown = [s for s in suites if s not in suite_names()]
    if unknown:
        raise ValueError(f"--suites {unknown}: known suites are {', '.join(suite_names())}")
    if len(set(suites)) < len(suites):  # (a suite twice paired each run with the other round's baseline)
        raise ValueError(f"--suites {args.suites}: a suite is named twice; name each once")
    args.suites = ",".join(suites) or None
    for flag, value, low in (("--prompts-per-suite", args.prompts_per_suite, 0), ("--repeats", args.repeats, 1),
                             ("--max-tokens", args.max_tokens, 1)):
        if value < low:
            raise ValueError(f"{flag} must be at least {low}, got {value}")
    out = Path(args.out).expanduser()
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {args.out} is a file; the results go in a folder: give a folder path")
    there = next(p for p in (out.absolute(), *out.absolute().parents) if p.exists())  # (checked now,
    if not there.is_dir() or not os.access(there, os.W_OK | os.X_OK):  # not after the whole run)
        raise ValueError(f"--out {args.out}: cannot make the results folder there ({there} is "
                         f"{'a file' if not there.is_dir() else 'not writable'})")
    if args.drafter is not None and not any(n.partition("@")[0] in HEADS for n in names):
        config = Path(args.drafter).expanduser() / "config.json"
        kind = json.loads(config.read_text()).get("mlx_spec", {}).get("drafter") if config.is_file() else None
        if kind not in HEADS:
            raise ValueError(f"--drafter {args.drafter}: name the method that runs it in --methods "
                             f"(one of {', '.join(HEADS)})")
        names.append(kind)
    args.methods = ",".join(names)


def _draft_length(k: str) -> bool:
    from mlx_spec.request import check_num_draft

    try:
        check_num_draft(int(k) if k.isdigit() else k)
        return True
    except ValueError:
        return False


def _apply_preset(args, preset) -> None:
    args.model = args.model or preset.model.name
    if preset.draft is not None:
        args.draft_model = args.draft_model or preset.draft.name
    args.methods = args.methods or ",".join(preset.methods)
    args.num_draft_tokens = args.num_draft_tokens or ",".join(map(str, preset.ks))
    if preset.suites and not args.suites:
        args.suites = ",".join(preset.suites)


def parse_ks(text: str) -> list:
    """'2,4,auto' -> [2, 4, 'auto']."""
    out = []
    for part in text.split(","):
        part = part.strip()
        if part:
            out.append(int(part) if part.lstrip("-").isdigit() else part)
    return out


def resolve_model(name: str, dtype: str = "float32") -> str:
    """A folder stays a folder; 'org/name' is a Hugging Face repo; a bare name is a zoo model."""
    path = Path(name).expanduser()
    if path.exists() or "/" in name:
        return str(path) if path.exists() else name
    try:
        from mlx_spec import zoo
    except ImportError as e:
        raise SystemExit(f"{name!r} is not a folder and the model zoo is unavailable ({e})")
    return str(zoo.fetch(name, dtype=dtype))


def _measure(args) -> dict | None:
    import mlx_spec

    from .hardware import busy_warning, describe, hardware_info, load_average
    from .harness import run_bench
    from .methods import BASELINE, Context, plan_variants
    from .suites import load_prompts, suite_names
    from .summary import check_identical, judge, summarize

    say = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    suites = args.suites.split(",") if args.suites else suite_names()
    prompts = load_prompts(suites, args.prompts_per_suite or None)
    say(f"loading {args.model}")
    rank = 0
    if args.shard is not None:
        from .. import distributed

        group = distributed.init(timeout=args.dist_timeout)
        model, tokenizer = distributed.load(resolve_model(args.model, args.dtype), args.shard, group)
        layout, rank = distributed.describe(model), group.rank()
        say = (lambda msg: None) if rank else say  # noqa: E731
        say(layout)
    else:
        model, tokenizer = mlx_spec.load(resolve_model(args.model, args.dtype))
    ctx = Context(model, tokenizer, drafter_path=args.drafter, temp=args.temp,
                  top_p=args.top_p, top_k=args.top_k, min_p=args.min_p)
    if args.draft_model:
        say(f"loading draft {args.draft_model}")
        draft_path = resolve_model(args.draft_model, args.dtype)
        ctx.draft_model, ctx.draft_tokenizer = mlx_spec.load(draft_path)
    plan = plan_variants(args.methods.split(","), parse_ks(args.num_draft_tokens), ctx)
    for s in plan.skipped:
        say(f"skipping {s}")
    hw = hardware_info()
    for w in hw["warnings"]:
        say(f"WARNING: {w}")
    cost = _cost_curve(model, args, say)
    say(f"{len(plan.variants)} methods x {len(prompts)} prompts x {args.repeats} repeats, "
        f"{args.max_tokens} new tokens each")
    tic, loads = time.time(), [load_average()]
    records = run_bench(ctx, plan.variants, prompts, repeats=args.repeats,
                        max_tokens=args.max_tokens, seed=args.seed,
                        progress=lambda msg: (loads.append(load_average()), say(msg)))
    hw["load_average"] = {"max": max((x for x in loads if x is not None), default=None),
                          "start": loads[0], "end": load_average()}
    busy = busy_warning(loads, hw["cpu_count"])
    if busy:
        hw["warnings"].append(busy)
        say(f"WARNING: {busy}")
    if rank:
        return None
    summary = summarize(records, BASELINE)
    identical = check_identical(records, BASELINE)
    return {
        "schema": 1,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "command": "mlx-spec bench " + " ".join(shlex.quote(a) for a in sys.argv[2:])
        if sys.argv[1:2] == ["bench"] else " ".join(shlex.quote(a) for a in sys.argv),
        "wall_s": time.time() - tic,
        "config": _config(args, [v.label for v in plan.variants], suites, BASELINE),
        "hardware": hw,
        "hardware_line": describe(hw),
        "verify_cost": cost,
        "summary": summary,
        "identical": identical,
        **judge(records, summary, identical, suites, greedy=args.temp == 0),
        "skipped": plan.skipped,
        "runs": records,
    }


def _judged(result: dict) -> dict:
    """A saved results.json judged again from its own run records on `--load`: the head-to-head
    table, the targets and their notes by this version's rules (a file saved by an older
    mlx-spec may lack them, or hold what older rules made of the same runs)."""
    from .summary import judge

    if not result.get("runs"):
        return result
    return {**result, **judge(result["runs"], result["summary"], result["identical"],
                              result["config"]["suites"], greedy=result["config"]["temp"] == 0)}


def _config(args, labels: list[str], suites: list[str], baseline: str) -> dict:
    return {
        "model_name": args.model, "draft_model": args.draft_model, "drafter": args.drafter,
        "methods": labels, "baseline": baseline,
        "num_draft_tokens": parse_ks(args.num_draft_tokens), "suites": suites,
        "prompts_per_suite": args.prompts_per_suite, "max_tokens": args.max_tokens,
        "repeats": args.repeats, "temp": args.temp, "top_p": args.top_p, "top_k": args.top_k,
        "min_p": args.min_p, "seed": args.seed, "preset": args.preset, "dtype": args.dtype,
    }


def _cost_curve(model, args, say) -> dict | None:
    """The target's verify cost curve (the same measurement adaptive k calibrates with)."""
    from .cost import verify_times

    if args.cost_repeats <= 0:
        return None
    say(f"measuring the verify cost curve (n = 1..16, {args.cost_context} tokens of context)")
    seconds = verify_times(model, 16, args.cost_context, args.cost_repeats)
    return {"context": args.cost_context, "seconds": seconds,
            "relative": [t / seconds[0] for t in seconds]}


def _report(result: dict, args, out: Path) -> int:
    from . import claims as claims_mod
    from .report import chart, markdown, write_json

    print(markdown(result))
    if not args.load:
        write_json(result, out / "results.json")
        print(f"\nresults: {out / 'results.json'}", file=sys.stderr)
    skipped = chart(result, out / "chart.png")
    print(skipped or f"chart: {out / 'chart.png'}", file=sys.stderr)
    if args.claims:
        print()
        print(claims_mod.claims_markdown(claims_mod.compare(result, claims_mod.load_claims()), result))
    return 0


def _list_presets() -> None:
    from .claims import PRESETS, load_claims

    for p in PRESETS.values():
        print(f"{p.name}: {p.summary}\n    claims: {', '.join(p.claims)}")
    print("\nclaims: " + ", ".join(c["id"] for c in load_claims()))
