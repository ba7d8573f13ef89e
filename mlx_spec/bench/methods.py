"""The method table: every way of decoding the benchmark compares, one entry each.

A method is a function that streams responses (objects with `.token` and
`.from_draft`) for a prompt's token ids. mlx-lm's own plain and speculative
decoding are entries like any drafter of ours, so adding a drafter kind is one
line in `METHODS`. k values are passed through untouched: a k the engine
rejects (e.g. "auto" for mlx-lm) is filtered by the entry's `accepts_k`.

Head drafters (MTP, EAGLE, EAGLE-3, DFlash, DSpark) are loaded with
`mlx_spec.load_drafter(--drafter PATH, model, kind)`; an entry reports "not
implemented" when no loader for its kind is registered in `mlx_spec.heads`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterator


@dataclass
class Context:
    """What methods may need: the target, optional draft model or head folder, sampling."""

    model: object
    tokenizer: object
    draft_model: object | None = None
    draft_tokenizer: object | None = None
    drafter_path: str | None = None
    temp: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    # One drafter per (method, k) for the whole run, as an application would keep it:
    # what adaptive k learns carries over from prompt to prompt.
    drafters: dict = field(default_factory=dict)


# (ctx, prompt ids, k, max_tokens, seed) -> iterator of responses
StreamFn = Callable[[Context, list, object, int, "int | None"], Iterator]


@dataclass(frozen=True)
class Method:
    name: str
    summary: str
    stream: StreamFn
    engine: str = "mlx-spec"
    uses_k: bool = False
    default_k: int | None = None  # always measured (mlx-lm's own default)
    accepts_k: Callable[[object], bool] = lambda k: True
    requires: tuple[str, ...] = ()  # Context fields that must be set
    unavailable: Callable[[], str | None] = lambda: None  # why it cannot run at all


@dataclass(frozen=True)
class Variant:
    """One method at one k: a row of the results."""

    method: Method
    k: object = None

    @property
    def label(self) -> str:
        return self.method.name if self.k is None else f"{self.method.name}@{self.k}"


def _sampler(ctx: Context):
    from mlx_lm.sample_utils import make_sampler

    return make_sampler(ctx.temp, ctx.top_p, min_p=ctx.min_p, top_k=ctx.top_k)


def _mlx_lm(draft: bool) -> StreamFn:
    def stream(ctx, ids, k, max_tokens, seed):
        import mlx.core as mx
        from mlx_lm import stream_generate

        if seed is not None:
            mx.random.seed(seed)
        kw = {"draft_model": ctx.draft_model, "num_draft_tokens": k} if draft else {}
        return stream_generate(ctx.model, ctx.tokenizer, ids, max_tokens=max_tokens,
                               sampler=_sampler(ctx), **kw)

    return stream


def _mlx_spec(make_drafter: Callable[[Context], object] | None) -> StreamFn:
    def stream(ctx, ids, k, max_tokens, seed):
        import mlx_spec

        drafter = None
        if make_drafter is not None:
            if (make_drafter, k) not in ctx.drafters:
                ctx.drafters[(make_drafter, k)] = make_drafter(ctx)
            drafter = ctx.drafters[(make_drafter, k)]
        kw = {"num_draft_tokens": k} if drafter is not None else {}
        return mlx_spec.stream_generate(
            ctx.model, ctx.tokenizer, ids, drafter, max_tokens=max_tokens, temp=ctx.temp,
            top_p=ctx.top_p, top_k=ctx.top_k, min_p=ctx.min_p, seed=seed, trace=True, **kw)

    return stream


def _ngram(ctx):
    from mlx_spec import NGramDrafter

    return NGramDrafter()


def _draft_model(ctx, lookup: bool = True, **kw):
    from mlx_spec import DraftModelDrafter

    return DraftModelDrafter(ctx.draft_model, ctx.draft_tokenizer, lookup=lookup, **kw)


def _mixed(ctx):
    from mlx_spec import MixedDrafter

    return MixedDrafter(_ngram(ctx), _draft_model(ctx))


def _head(kind: str) -> Method:
    """A head drafter read from `--drafter PATH`."""

    def make(ctx):
        from mlx_spec import load_drafter

        return load_drafter(ctx.drafter_path, ctx.model, kind)

    def unavailable():
        from mlx_spec import heads

        if kind in heads.LOADERS or kind in heads.TARGET_PROBES:
            return None
        return f"the {kind} drafter is not implemented in this mlx-spec yet"

    return Method(kind, f"mlx-spec with a {kind} head (--drafter PATH)", _mlx_spec(make),
                  uses_k=True, requires=("drafter_path",), unavailable=unavailable)


def _is_int(k) -> bool:
    return isinstance(k, int)


METHODS: dict[str, Method] = {
    "baseline": Method("baseline", "mlx-lm's plain decoding (mlx_lm.stream_generate)",
                       _mlx_lm(draft=False), engine="mlx-lm"),
    "mlx-spec": Method("mlx-spec", "mlx-spec's loop without a drafter (its overhead)",
                       _mlx_spec(None)),
    "mlx-lm-draft": Method("mlx-lm-draft", "mlx-lm's speculative decoding with --draft-model",
                           _mlx_lm(draft=True), engine="mlx-lm", uses_k=True, default_k=2,
                           accepts_k=_is_int, requires=("draft_model",)),
    "ngram": Method("ngram", "mlx-spec prompt lookup (NGramDrafter)", _mlx_spec(_ngram),
                    uses_k=True),
    "draft": Method("draft", "mlx-spec with --draft-model (DraftModelDrafter)",
                    _mlx_spec(_draft_model), uses_k=True, requires=("draft_model",)),
    "draft-no-lookup": Method("draft-no-lookup", "mlx-spec with --draft-model, its chains never guided "
                              "by prompt lookup (--no-lookup)", _mlx_spec(lambda ctx: _draft_model(ctx, False)),
                              uses_k=True, requires=("draft_model",)),
    "draft-full-vocab": Method("draft-full-vocab", "mlx-spec with --draft-model, its LM head over the whole "
                               "vocabulary (--draft-head-vocab 0)",
                               _mlx_spec(lambda ctx: _draft_model(ctx, head_vocab=None)),
                               uses_k=True, requires=("draft_model",)),
    "draft-no-stop": Method("draft-no-stop", "mlx-spec with --draft-model, its chains as long as asked "
                            "(--draft-min-confidence 0)",
                            _mlx_spec(lambda ctx: _draft_model(ctx, min_confidence=None)),
                            uses_k=True, requires=("draft_model",)),
    "mixed": Method("mixed", "mlx-spec with n-gram and --draft-model in one tree (--draft ngram+model)",
                    _mlx_spec(_mixed), uses_k=True, requires=("draft_model",)),
    **{kind: _head(kind) for kind in ("mtp", "eagle", "eagle3", "dflash", "dspark")},
}
DEFAULT_METHODS = ("baseline", "mlx-spec", "mlx-lm-draft", "ngram", "draft")
BASELINE = "baseline"


@dataclass
class Plan:
    variants: list[Variant] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)  # "method: why"


def plan_variants(names: list[str], ks: list, ctx: Context,
                  table: dict[str, Method] | None = None) -> Plan:
    """The variants to run, baseline first; methods that cannot run go to `skipped`.

    A name may fix its own draft lengths (`draft@auto`, `mlx-lm-draft@4`): that method runs
    at those alone (and at its `default_k`), not at every k of `ks`."""
    table = METHODS if table is None else table
    plan = Plan()
    own: dict[str, list] = {}
    for n in names:
        name, at, k = n.partition("@")
        if at:
            own.setdefault(name, []).append(int(k) if k.isdigit() else k)
    for name in set(names) & set(own):  # named bare too: the sweep as well as its own lengths
        own[name] = list(ks) + own[name]
    names = list(dict.fromkeys(n.partition("@")[0] for n in names))
    unknown = [n for n in names if n not in table]
    if unknown:
        raise ValueError(f"unknown method(s) {unknown}; known: {', '.join(table)}")
    if BASELINE not in names:
        names = [BASELINE, *names]  # every speed-up is relative to it
    for name in names:
        m, ks_m = table[name], own.get(name, ks)
        why = m.unavailable()
        missing = [r for r in m.requires if getattr(ctx, r, None) is None]
        if why or missing:
            flags = ", ".join("--" + r.replace("_path", "").replace("_", "-") for r in missing)
            plan.skipped.append(f"{name}: {why or 'needs ' + flags}")
            continue
        if not m.uses_k:
            plan.variants.append(Variant(m))
            continue
        wanted = ([m.default_k] if m.default_k is not None else []) + list(ks_m)
        kept = [k for k in dict.fromkeys(wanted) if m.accepts_k(k)]
        plan.skipped += [f"{name}@{k}: not supported by {m.engine}" for k in ks_m if not m.accepts_k(k)]
        plan.variants += [Variant(m, k) for k in kept]
    return plan
