"""A target sharded over several processes (Macs) with `mx.distributed`.

Every rank runs the same decode loop on the same tokens; only the target's
forward is split. The sharded target is the *same model instance*, changed in
place (never its class), so every drafter, cache and stop rule works as is:

* `tensor`: the family's own mlx-lm `shard()` (each linear split over the ranks,
  an `all_sum` after attention and after the MLP). Every rank ends a layer with
  the same hidden state, so the logits are identical on every rank.
* `pipeline`: consecutive layers per rank. mlx-lm's `pipeline()` where the
  family has one (qwen2, qwen3_5, deepseek_v2/v3, glm4_moe, ...); otherwise our
  stage wrappers (llama, qwen3, mistral: the families whose forward is
  "embed, layers, norm"). Rank 0 holds the first layers; each stage receives
  the hidden state from the rank before, runs its layers and sends it on; the
  last stage's output is then summed with zeros from every other rank
  (`all_sum`, exact), so every rank computes the same logits with its own copy
  of the final norm and LM head. Each rank keeps (and reads from disk) only its
  own layers, and holds caches only for them; the cache rollback is unchanged.

Acceptance needs no extra message: logits and the per-request RNG are the same
on every rank. Two choices that depend on timings are agreed explicitly
(`agree_lengths`, `agreed_curve`): the adaptive draft length and the verify cost
curve. With `MLX_SPEC_CHECK_SYNC=1` every target forward first compares a
fingerprint of its input tokens across the ranks and raises `DesyncError`
naming the rank and forward, instead of hanging on mismatched messages.
`MLX_SPEC_LINK_LATENCY_MS` adds a sleep before each message this module puts in
a forward (see docs/distributed.md: a simulated slow link). With a timeout
(`init(timeout=...)`, `--dist-timeout`), a rank that waits longer than that
for the others, connecting or in a forward, ends with an error naming itself
and the forward (`mlx_spec.watchdog`).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import mlx.core as mx

from . import watchdog
from .stage_taps import GatherAtNorm, StageTaps
from .taps import SeeThrough, decoder_stack, final_norm_name

CHECK_ENV = "MLX_SPEC_CHECK_SYNC"
LATENCY_ENV = "MLX_SPEC_LINK_LATENCY_MS"
MODES = ("pipeline", "tensor")
DEFAULT_TIMEOUT = watchdog.DEFAULT_TIMEOUT
# Families whose inner model is "embed_tokens -> layers -> norm" with one cache per layer
# (gemma3: each stage layer makes its own mask, see `_gemma3_stage`).
STAGED = {"llama", "qwen3", "mistral", "gemma3_text", "gemma3"}


class ConnectError(ValueError):
    """This rank could not join the others (a ValueError: commands report it in one line)."""


class DesyncError(RuntimeError):
    """Ranks about to run different target forwards (a bug, or ranks not running the same job)."""


@dataclass
class Shard:
    group: object  # mx.distributed.Group
    mode: str
    layers: tuple[int, int]  # this rank's layers [start, end) (all of them under tensor)
    total_layers: int
    stats: "LinkStats"
    taps: StageTaps | None = None  # layer taps gathered on every rank (pipeline)
    offset: int = 0  # index in the layer list of layer 0 (our stages keep only their own)

    @property
    def rank(self) -> int:
        return self.group.rank()

    @property
    def size(self) -> int:
        return self.group.size()

    def local_index(self, layer: int) -> int | None:
        """Where decoder layer `layer` sits in this rank's layer list; None on other ranks."""
        start, end = self.layers
        return layer - self.offset if start <= layer < end else None


class LinkStats:
    """Counts the messages the stage wrappers put into forwards; with `MLX_SPEC_LINK_LATENCY_MS`
    sleeps that long before each (while the graph is built: see docs/distributed.md)."""

    def __init__(self):
        self.messages = 0
        self.latency = float(os.environ.get(LATENCY_ENV, "0") or 0) / 1000

    def message(self) -> None:
        self.messages += 1
        if self.latency:
            time.sleep(self.latency)


def init(backend: str = "any", timeout: float | None = None):
    """This process's group (size 1 when not started by `mlx.launch`).

    `timeout`: seconds this rank may wait for the others, first while connecting (MLX's
    ring backend retries without a limit), then in any target forward; past it the rank
    ends with an error naming it and where it waited (None or 0: no limit)."""
    rank = os.environ.get("MLX_RANK")
    where = ("connecting to the other ranks (mx.distributed.init; check the hosts, ports and "
             "that every rank was started)")
    try:
        with watchdog.outside(timeout if rank is not None else None, rank, where):
            group = mx.distributed.init(strict=False, backend=backend)  # holds the interpreter lock
    except RuntimeError as e:  # e.g. "[ring] Couldn't bind socket": a port in use
        raise ConnectError(f"rank {rank} could not join the other ranks: {e} (a port in use, "
                           "e.g. by another launch? mlx-spec launch --starting-port picks "
                           "others)") from e
    if not timeout or rank is None:
        return group
    watchdog.watch(timeout, group.rank())  # armed by the first forward: reading weights takes
    return group                           # as long as it takes


def shard_of(model) -> Shard | None:
    """The `Shard` of a target sharded here, or None."""
    return getattr(model, "_mlx_spec_shard", None)


def load(path: str, mode: str, group=None):
    """Load `path` lazily, shard it over `group`, then read only this rank's weights.

    Returns (model, tokenizer)."""
    import mlx_spec

    if mode not in MODES:
        raise ValueError(f"--shard must be one of {', '.join(MODES)}, got {mode!r}")
    group = group or init()
    if group.size() < 2:
        raise ValueError("--shard needs two or more processes: start them with "
                         "`mlx-spec launch -n 2 -- generate ...` (or mlx.launch)")
    model, tokenizer = mlx_spec.load(path, lazy=True)
    shard_model(model, mode, group)
    mx.eval(model.parameters())
    return model, tokenizer


def shard_model(model, mode: str, group) -> Shard:
    """Shard `model` in place over `group` (`tensor` or `pipeline`); returns its `Shard`."""
    if shard_of(model) is not None:
        raise ValueError("this model is already sharded")
    family = getattr(getattr(model, "args", None), "model_type", type(model).__module__)
    total = len(model.layers)
    size = group.size()
    stats = LinkStats()
    taps, offset = StageTaps(group, stats), 0
    if mode == "tensor":
        if not hasattr(model, "shard"):
            raise ValueError(f"model family {family!r} has no tensor-parallel shard() in mlx-lm; "
                             "use --shard pipeline")
        if hasattr(model, "check_shard"):  # a target with its own rules (deepseek_v4)
            model.check_shard(size)
        else:
            _check_heads(model, size, family)
        model.shard(group)
        span = (0, total)
    elif mode == "pipeline":
        if size > total:
            raise ValueError(f"{size} ranks but the model has only {total} layers: "
                             "use at most one rank per layer")
        inner = decoder_stack(model)
        if hasattr(inner, "pipeline"):  # mlx-lm's own (rank 0 holds the *last* layers)
            # (a target may split for its inner model's pipelined forward itself: deepseek_v4)
            (model if hasattr(model, "pipeline") else inner).pipeline(group)
            span = (inner.start_idx, inner.end_idx)
            # the first module after the forward's all_gather, on every rank: the final norm,
            # or where the target says (its input must have the layer taps' shape)
            norm = getattr(model, "stage_gather_at", None) or final_norm_name(inner)
            if norm:
                setattr(inner, norm, GatherAtNorm(getattr(inner, norm), taps))
            else:  # nowhere to gather layer taps: Taps refuses them
                taps = None
        elif family in STAGED:
            span = _stage(model, inner, group, stats, taps)
            offset = span[0]
        else:
            raise ValueError(f"model family {family!r} cannot be split into pipeline stages yet "
                             f"(supported: mlx-lm pipeline() families, and {', '.join(sorted(STAGED))})")
    else:
        raise ValueError(f"--shard must be one of {', '.join(MODES)}, got {mode!r}")
    shard = Shard(group, mode, span, total, stats, taps, offset)
    object.__setattr__(model, "_mlx_spec_shard", shard)  # a plain attribute, not a parameter
    stack = decoder_stack(model)  # counts forwards (watchdog); checks them in debug mode
    stack.embed_tokens = _Forward(stack.embed_tokens, shard,
                                  os.environ.get(CHECK_ENV, "") not in ("", "0"))
    return shard


def _check_heads(model, size: int, family: str) -> None:
    args = model.args
    for name in ("num_attention_heads", "num_key_value_heads"):
        n = getattr(args, name, None)
        if isinstance(n, int) and n % size:
            raise ValueError(f"{family}: {name} = {n} is not divisible by {size} ranks; "
                             "tensor parallel needs it to be (use --shard pipeline)")


def _split(total: int, size: int, rank: int) -> tuple[int, int]:
    """Consecutive layers for `rank`; the first ranks take one more when it does not divide."""
    base, extra = divmod(total, size)
    start = rank * base + min(rank, extra)
    return start, start + base + (rank < extra)


def _stage(model, inner, group, stats: LinkStats, taps: StageTaps) -> tuple[int, int]:
    """Keep this rank's layers in `inner` (an instance), wrapped to receive and send."""
    size, rank = group.size(), group.rank()
    start, end = _split(len(inner.layers), size, rank)
    local = list(inner.layers[start:end])
    if hasattr(inner, "sliding_window_pattern"):  # gemma3
        local = _gemma3_stage(model, inner, local)
    if rank > 0:
        local[0] = _Receive(local[0], group, stats)
    local[-1] = _SendOn(local[-1], group, taps)
    inner.layers = local
    # llama keeps the index of its first full-attention (and sliding) layer for the masks
    for attr, sliding in (("fa_idx", False), ("swa_idx", True)):
        if hasattr(inner, attr):
            found = [i for i, l in enumerate(local) if bool(getattr(l, "use_sliding", False)) == sliding]
            if not found and not sliding:
                raise ValueError(f"pipeline stage {rank} (layers {start}..{end - 1}) has no "
                                 "full-attention layer; use more layers per rank")
            setattr(inner, attr, found[0] if found else None)
    return start, end


def _gemma3_stage(model, inner, local: list) -> list:
    """Gemma 3 picks each layer's mask (sliding window or global) by its position in the
    layer list, from the caches at positions 0 and `sliding_window_pattern - 1`, and its
    `make_cache` builds caches by position for every layer of the model. A stage holds
    other positions: each of its layers makes its own mask from its own cache (every
    cache of one kind is at the same offset, so the mask is the whole model's), the
    model computes only one (unused) mask, and this instance builds caches for its own
    layers, by the kind each layer was built as (`self_attn.is_sliding`). The window is
    read when used (`inner.window_size`, as the model's own mask reads it)."""
    from mlx_lm.models.cache import KVCache, RotatingKVCache

    sliding = [bool(layer.self_attn.is_sliding) for layer in local]
    inner.sliding_window_pattern = 1  # one mask, from cache[0], which every stage has

    def make_cache():
        return [RotatingKVCache(max_size=inner.window_size) if s else KVCache() for s in sliding]

    object.__setattr__(getattr(model, "language_model", model), "make_cache", make_cache)
    return [_OwnMask(layer, (lambda: inner.window_size) if s else (lambda: None))
            for layer, s in zip(local, sliding)]


class _OwnMask(SeeThrough):
    """A gemma3 stage layer: its attention mask from its own cache, whatever it is passed."""

    def __init__(self, inner, window):
        super().__init__(inner)
        self.window = window  # () -> the sliding window, or None for a global layer

    def __call__(self, h, mask=None, cache=None, **kwargs):
        from mlx_lm.models.base import create_attention_mask

        mask = create_attention_mask(h, cache, window_size=self.window())
        return self.inner(h, mask, cache, **kwargs)


class _Receive(SeeThrough):
    """The first layer of a later stage: its input comes from the rank before."""

    tap_inside = True  # a tap of its input means the layer's input, not the embedding

    def __init__(self, inner, group, stats):
        super().__init__(inner)
        self._group, self._stats = group, stats

    def __call__(self, h, mask=None, cache=None, **kwargs):
        self._stats.message()
        h = mx.distributed.recv_like(h, self._group.rank() - 1, group=self._group)
        return self.inner(h, mask, cache, **kwargs)


class _SendOn(SeeThrough):
    """The last layer of a stage: send its output on; every rank gets the last stage's
    (and, on the same message, the layer taps of every stage: `StageTaps.ride`)."""

    tap_inside = True  # its output is the last stage's, not this layer's

    def __init__(self, inner, group, taps: StageTaps):
        super().__init__(inner)
        self._group, self._stats, self._taps = group, taps.stats, taps

    def __call__(self, h, mask=None, cache=None, **kwargs):
        out = self.inner(h, mask, cache, **kwargs)
        group, rank = self._group, self._group.rank()
        if rank < group.size() - 1:
            self._stats.message()
            sent = mx.distributed.send(out, rank + 1, group=group)
            # Whoever evaluates this rank's cache (a prefill chunk) or logits sends too.
            if cache is not None and isinstance(getattr(cache, "keys", None), mx.array):
                cache.keys = mx.depends(cache.keys, sent)
            else:  # (quantized caches hold tuples) send as soon as the stage is computed
                mx.async_eval(sent)
            out = mx.depends(mx.zeros_like(out), sent)
        return self._taps.ride(out)  # the last stage's h, on every rank


class _Forward(SeeThrough):
    """The embedding: each target forward starts here. Tells the watchdog, and with `check`
    first makes sure every rank feeds the same tokens (debug)."""

    def __init__(self, inner, shard: Shard, check: bool):
        super().__init__(inner)
        self._shard, self._check = shard, check
        self._forwards = 0

    def __call__(self, ids):
        self._forwards += 1
        where = f"target forward {self._forwards}"
        watchdog.beat(where)
        if self._check:
            check_same(self._shard.group, fingerprint(ids, self._forwards), where)
        return self.inner(ids)


def fingerprint(ids: mx.array, counter: int) -> list[int]:
    flat = ids.reshape(-1).astype(mx.uint32)
    weights = (mx.arange(flat.size, dtype=mx.uint32) * 2654435761 + 1).astype(mx.uint32)
    mixed = (flat * weights).sum() if flat.size else mx.array(0, mx.uint32)
    shape = list(ids.shape) + [0] * (2 - ids.ndim)
    return [counter, *shape[:2], int(mixed.item()) & 0x7FFFFFFF]


def check_same(group, values: list[int], where: str) -> None:
    """Raise `DesyncError` on every rank when `values` differ between ranks."""
    mine = mx.array(values, mx.int32)
    rows = mx.distributed.all_gather(mine[None], group=group).tolist()
    bad = [r for r, row in enumerate(rows) if row != rows[0]]
    if bad:
        raise DesyncError(f"rank {bad[0]} is out of step with rank 0 at {where}: "
                          f"rank 0 has {rows[0]}, rank {bad[0]} has {rows[bad[0]]} "
                          "(forward number, batch, tokens, token hash)")


def barrier(group=None) -> None:
    """Return when every rank of `group` (default: the launch's) has called it."""
    mx.eval(mx.distributed.all_sum(mx.array(1), group=group or init()))


def _config_print(model) -> int:
    """A 31-bit checksum of the model's configuration (the same on every rank of one model)."""
    import dataclasses
    import json
    import zlib

    args = getattr(model, "args", None)
    fields = dataclasses.asdict(args) if dataclasses.is_dataclass(args) else vars(args) if args is not None else {}
    return zlib.crc32(json.dumps(fields, sort_keys=True, default=str).encode()) & 0x7FFFFFFF


def describe(model) -> str:
    """One line per rank: its layers and weight memory (a collective: call on every rank)."""
    from mlx.utils import tree_flatten

    shard = shard_of(model)
    weights = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    mine = mx.array([shard.layers[0], shard.layers[1], weights // 1024, _config_print(model)], mx.int32)
    rows = mx.distributed.all_gather(mine[None], group=shard.group).tolist()
    other = [r for r, row in enumerate(rows) if row[3] != rows[0][3]]
    if other:  # each Mac may hold its own copy: a different one would desynchronise the ranks
        raise ValueError(f"rank {other[0]} loaded a model of another configuration than rank 0's: give "
                         "every rank the same model (same config.json)")
    rows = [row[:3] for row in rows]
    lines = [f"rank {r}: layers {a}..{b - 1} of {shard.total_layers}, weights {kb / 1024:.1f} MiB"
             for r, (a, b, kb) in enumerate(rows)]
    return f"{shard.mode} parallel over {shard.size} ranks\n" + "\n".join(lines)
