"""Taps: record target hidden states during the verify forward, for head drafters.

`Taps(model, ids)` wraps the *instance's* decoder layers (and, if asked, its
final norm) with transparent recorders; mlx-lm classes are never patched and
`remove()` restores the originals. Recorders are shared and counted: two live
generators on one model read the same recorder (each right after its own
forward), and the last `remove()` unwraps it. One internal meaning of a tap id:

* `k >= 0`       the output of decoder layer k (0-based), i.e. HF
                 `hidden_states[k + 1]`;
* `EMBED`        the input of decoder layer 0 (the embedding output);
* `FINAL_NORM`   the output of the final norm (what the LM head reads).

Converters translate each checkpoint's convention into these ids. When no
drafter asks for taps nothing is installed, so they cost nothing.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

EMBED = "embed"
FINAL_NORM = "final_norm"


class SeeThrough(nn.Module):
    """A module wrapping `inner` whose attributes it passes on (models read attributes of
    their layers, e.g. `layer.use_sliding`)."""

    # A wrapper whose input or output is not its inner module's (a pipeline stage's first
    # layer receives its input; its last hands every rank the last stage's output): taps
    # go inside it.
    tap_inside = False

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def __getattr__(self, key):
        if key in self:
            return self[key]
        if "inner" not in self:
            raise AttributeError(key)
        return getattr(self["inner"], key)


class _Recorder(SeeThrough):
    """Calls the wrapped module and keeps its output (or its first input)."""

    def __init__(self, inner: nn.Module, keep_input: bool, keep_output: bool):
        super().__init__(inner)
        # Plain attributes (not arrays/dicts), so nn.Module does not count the
        # recorded activations as parameters.
        self.keep_input, self.keep_output = keep_input, keep_output
        self.users = 0  # Taps objects reading this recorder; the last one out unwraps
        self.seen = _Seen()

    def __call__(self, x, *args, **kwargs):
        out = self.inner(x, *args, **kwargs)
        if self.keep_input:
            self.seen.inp = x
        if self.keep_output:
            self.seen.out = out[0] if isinstance(out, tuple) else out
        return out


class _Seen:
    inp: mx.array | None = None
    out: mx.array | None = None


def decoder_stack(model) -> nn.Module:
    """The module that owns the decoder-layer list and the final norm (`model.model`, or
    `model.backbone` in mlx-lm's Mamba-style hybrids such as Nemotron-H)."""
    lm = getattr(model, "language_model", None)
    for cand in (getattr(model, "model", None), getattr(lm, "model", None), getattr(model, "backbone", None), model):
        if cand is not None and isinstance(getattr(cand, "layers", None), list):
            return cand
    raise ValueError(
        f"cannot find the decoder layers of {type(model).__name__}: taps need an "
        "mlx-lm model whose decoder layers sit in a list (model.model.layers)"
    )


def final_norm_name(stack) -> str | None:
    """The attribute holding the stack's final norm: `norm` (most models), `norm_f` (Nemotron-H)."""
    return next((n for n in ("norm", "norm_f") if hasattr(stack, n)), None)


# mlx-lm models that multiply the token embedding by sqrt(hidden size) inside their forward, as
# Hugging Face's scaled word embedding does: module -> the dtype the factor is rounded to first
_INLINE_SCALE = {"mlx_lm.models.gemma": None, "mlx_lm.models.gemma2": None,
                 "mlx_lm.models.gemma3_text": mx.bfloat16}


def embedding_scale(stack) -> float:
    """The factor the stack multiplies its token embedding by before the first layer: what
    Hugging Face's `embed_tokens` returns, over the raw rows (Gemma's sqrt(H); 1 for most)."""
    if hasattr(stack, "embed_scale"):  # (mlx-lm's Gemma 4 keeps it as an attribute)
        return float(stack.embed_scale)
    if type(stack).__module__ in _INLINE_SCALE:
        factor, dtype = stack.args.hidden_size ** 0.5, _INLINE_SCALE[type(stack).__module__]
        return float(mx.array(factor, dtype).item()) if dtype is not None else factor
    return 1.0


def embedding(stack) -> nn.Module:
    """The stack's token embedding: `embed_tokens` (most models), `embeddings` (Nemotron-H),
    without wrappers (a drafter's lookups are not target forwards)."""
    for name in ("embed_tokens", "embeddings"):
        if name in stack:
            m = stack[name]
            while isinstance(m, SeeThrough):
                m = m.inner
            return m
    raise ValueError(f"cannot find the token embedding of {type(stack).__name__} (embed_tokens)")


def in_pieces(model, calls) -> list:
    """Run one forward of `model` made of several calls (pieces of the sequence, in
    order), so that recorders hold the whole forward: each recorded input/output is the
    concatenation, along the sequence axis, of what the pieces recorded. For targets
    whose forward splits a block (`mlx_spec.targets.deepseek_v4`). Returns the calls' results."""
    stack = decoder_stack(model)
    norm = final_norm_name(stack)
    recs = [r for r in map(_recorder, [*stack.layers, getattr(stack, norm) if norm else None]) if r]
    seen = {id(r): ([], []) for r in recs}
    shard = getattr(model, "_mlx_spec_shard", None)
    staged = shard.taps if shard is not None and shard.taps is not None and shard.taps.entries else None
    gathered = []  # a pipeline split's gathered layer taps, per piece (mlx_spec/stage_taps.py)
    results = []
    for call in calls:
        results.append(call())
        if staged is not None:
            gathered.append(staged.values)
        for r in recs:
            if r.keep_input:
                seen[id(r)][0].append(r.seen.inp)
            if r.keep_output:
                seen[id(r)][1].append(r.seen.out)
    for r in recs:
        inp, out = seen[id(r)]
        if inp:
            r.seen.inp = mx.concatenate(inp, axis=1)
        if out:
            r.seen.out = mx.concatenate(out, axis=1)
    if gathered:
        staged.values = {tid: mx.concatenate([g[tid] for g in gathered], axis=1) for tid in gathered[0]}
    return results


def layer_count(model) -> int:
    """The target's decoder layers, all ranks' together on a sharded target."""
    shard = getattr(model, "_mlx_spec_shard", None)
    return shard.total_layers if shard is not None else len(decoder_stack(model).layers)


def _recorder(m) -> _Recorder | None:
    """The recorder in a chain of wrappers (another wrapper may sit on top for one forward)."""
    while isinstance(m, SeeThrough) and not isinstance(m, _Recorder):
        m = m.inner
    return m if isinstance(m, _Recorder) else None


class Taps:
    """Install recorders for `ids` on `model`; `read()` returns {id: [T, H]}."""

    def __init__(self, model, ids):
        self.ids = tuple(ids)
        self.stack = decoder_stack(model)
        layers = self.stack.layers
        self._installed: list[tuple[object, object, _Recorder]] = []  # (owner, key, recorder)
        self._where: dict[object, tuple[_Recorder, str]] = {}
        shard = getattr(model, "_mlx_spec_shard", None)
        # On a pipeline split a layer's output lives on one rank; `Shard.taps` brings the
        # layer taps to every rank within each forward (mlx_spec/stage_taps.py).
        self._stage = shard.taps if shard is not None and shard.mode == "pipeline" else None
        self._staged: list = []
        if shard is not None and shard.mode == "pipeline" and self._stage is None and any(
                t != FINAL_NORM for t in self.ids):
            raise ValueError(f"this drafter reads hidden states of decoder layers {list(self.ids)}, "
                             "which sit on other ranks, and this target's pipeline split has no "
                             "final norm to gather them at; use --shard tensor")
        n = layer_count(model)
        for tid in self.ids:  # all ids are checked before anything is wrapped
            if tid == FINAL_NORM and final_norm_name(self.stack) is None:
                raise ValueError(f"{type(model).__name__} has no final norm to tap")
            if tid not in (FINAL_NORM, EMBED) and not (isinstance(tid, int) and 0 <= tid < n):
                raise ValueError(
                    f"tap {tid!r} is out of range: this target has {n} decoder layers "
                    f"(valid: 0..{n - 1}, {EMBED!r}, {FINAL_NORM!r})"
                )
        for tid in self.ids:
            if tid == FINAL_NORM:  # runs on every rank
                norm = final_norm_name(self.stack)
                self._where[tid] = (self._wrap(self.stack, norm, attr=True, keep_output=True), "out")
            elif self._stage is not None:
                if tid not in self._where:
                    self._add_staged(shard, tid)
            elif tid == EMBED:
                self._where[tid] = (self._wrap(layers, 0, attr=False, keep_input=True), "inp")
            else:
                self._where[tid] = (self._wrap(layers, tid, attr=False, keep_output=True), "out")

    def _add_staged(self, shard, tid) -> None:
        """A layer tap of a pipeline split: recorded on the rank holding the layer, read
        on every rank from the stage gather."""
        local, source = shard.local_index(0 if tid == EMBED else tid), None
        if local is not None:
            owner, key, attr = self.stack.layers, local, False
            current = owner[key]
            while getattr(current, "tap_inside", False):
                owner, key, attr, current = current, "inner", True, current.inner
            slot = "inp" if tid == EMBED else "out"
            source = (self._wrap(owner, key, attr, keep_input=tid == EMBED,
                                 keep_output=tid != EMBED), slot)
        self._stage.add(tid, source)
        self._staged.append(tid)
        self._where[tid] = (None, tid)

    def _wrap(self, owner, key, attr: bool, keep_input=False, keep_output=False) -> _Recorder:
        current = getattr(owner, key) if attr else owner[key]
        if isinstance(current, _Recorder):  # another id, or another live Taps, on this module
            current.keep_input |= keep_input
            current.keep_output |= keep_output
            rec = current
        else:
            rec = _Recorder(current, keep_input, keep_output)
            if attr:
                setattr(owner, key, rec)
            else:
                owner[key] = rec
        if all(r is not rec for _, _, r in self._installed):
            rec.users += 1
            self._installed.append((owner, key, rec))
        return rec

    def read(self, row: int = 0) -> dict:
        """{id: [T, H]} of batch row `row` in the last forward."""
        return {tid: (self._stage.values[slot] if rec is None else getattr(rec.seen, slot))[row]
                for tid, (rec, slot) in self._where.items()}

    def remove(self) -> None:
        """Stop reading; a recorder no other live `Taps` reads is unwrapped."""
        for owner, key, rec in reversed(self._installed):
            rec.users -= 1
            if rec.users:
                continue
            if isinstance(owner, list):
                owner[key] = rec.inner
            else:
                setattr(owner, key, rec.inner)
        self._installed.clear()
        for tid in self._staged:
            self._stage.drop(tid)
        self._staged.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.remove()
