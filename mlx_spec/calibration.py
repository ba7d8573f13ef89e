"""The target's verify cost curve: seconds of a forward over n tokens, measured once per model.

A forward over n tokens after a 128-token context is timed for n = 1..N_MAX (the
fastest of a few interleaved passes), cached on disk per model architecture,
weights' dtype, device and MLX version (`model_key`), and read back by every
later process. The adaptive draft-length policy (`mlx_spec.adaptive`) and a
batch's choice of draft length (`mlx_spec.batch_policy`) weigh tokens against
these seconds.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import platform
import threading
from pathlib import Path

from .cache import MAX_DRAFT

log = logging.getLogger("mlx_spec")

N_MAX = MAX_DRAFT + 1  # verify rows: y plus at most MAX_DRAFT drafted tokens


def cache_dir() -> Path:
    root = os.environ.get("MLX_SPEC_CACHE") or Path.home() / ".cache" / "mlx-spec"
    return Path(root) / "calibration"


_CURVES: dict[str, list[float]] = {}  # model_key -> verify seconds, this process


def model_key(model) -> str:
    """Identity of (model architecture and weights' dtype, device, MLX version).

    Computed on each call (a walk over the parameter tree): a model's dtype can
    change in place (`set_dtype`), so it is never cached per object.
    """
    import mlx.core as mx
    from mlx.utils import tree_flatten

    params = tree_flatten(model.parameters())
    dtypes = sorted({str(v.dtype) for _, v in params})
    n_params = sum(v.size for _, v in params)
    args = getattr(model, "args", None)
    config = {k: v for k, v in sorted(vars(args).items())} if args is not None else {}
    ident = {
        "class": f"{type(model).__module__}.{type(model).__name__}",
        "config": repr(config),
        "dtypes": dtypes,
        "params": n_params,
        "device": str(mx.default_device()),
        "machine": platform.machine(),
        "processor": _processor(),
        "mlx": mx.__version__,
    }
    shard = getattr(model, "_mlx_spec_shard", None)
    if shard is not None:  # a sharded forward's cost includes its messages
        ident["shard"] = [shard.mode, shard.size, shard.rank]
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:16]


def _processor() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def verify_seconds(model, n_max: int = N_MAX, recalibrate: bool = False) -> list[float]:
    """Seconds of a forward over n = 1..n_max tokens for this model on this device.

    Measured once and cached on disk (`cache_dir()`); when that folder cannot be
    read or written the curve is kept in memory for this process instead.
    """
    from .agreed import agreed_curve

    key = model_key(model)
    known = None
    if not recalibrate:
        known = _CURVES.get(key) or _read_curve(cache_dir() / f"{key}.json")
        known = known if known is not None and len(known) >= n_max else None

    def measure() -> list[float]:
        log.info("calibrating the verify cost curve of this model (once per model and device)")
        return measure_verify_seconds(model, max(n_max, len(_CURVES.get(key, ()))))

    times = agreed_curve(model, known, measure)  # a sharded target's ranks agree on it
    if times is not known:
        _write_curve(cache_dir() / f"{key}.json", times)
    _CURVES[key] = times
    return times[:n_max]


def _read_curve(path: Path) -> list[float] | None:
    try:
        times = [float(t) for t in json.loads(path.read_text())["verify_seconds"]]
    except (OSError, ValueError, KeyError, TypeError):
        return None  # absent, unreadable or damaged: measured again
    if not times or not all(math.isfinite(t) and t > 0 for t in times):
        log.info("ignoring %s: its costs are not positive seconds (measured again)", path)
        return None
    return times


def write_json(path: Path, data) -> None:
    """Write `data` to `path` whole or not at all (a temporary file, then a rename), so a
    reader in another process never sees half of it. Raises OSError when it cannot."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp")  # (writers in threads too)
    tmp.write_text(json.dumps(data))
    tmp.replace(path)


def _write_curve(path: Path, times: list[float]) -> None:
    try:
        write_json(path, {"verify_seconds": times})
    except OSError as e:
        log.warning("cannot write the calibration cache %s (%s); keeping it in memory "
                    "for this process (set MLX_SPEC_CACHE to a writable folder)", path, e)


_ONCE = [0.0]  # seconds this process spent inside steps on work that is not the step's own


def one_time_seconds() -> float:
    """Seconds spent so far inside decode steps on one-time work: measuring cost curves (a
    batch met a new width) and a draft model reading its backlog (the prompt) before its
    first draft. A step subtracts them from the time it learns its shape's cost from."""
    return _ONCE[0]


def spent_once(seconds: float) -> None:
    _ONCE[0] += seconds


def measure_verify_seconds(model, n_max: int = N_MAX, context: int = 128, repeats: int = 3) -> list[float]:
    """Seconds of a forward over n = 1..n_max tokens after `context` cached tokens.

    The fastest of `repeats` interleaved passes (interference only ever adds
    time), made non-decreasing in n (a wider block never costs less).
    """
    import time

    import mlx.core as mx

    start = time.perf_counter()

    from .cache import make_cache, rollback
    from .drafters.base import vocab_size

    cache = make_cache(model)
    ids = (mx.arange(context + n_max) * 7919 + 3) % vocab_size(model)  # any valid tokens
    mx.eval(model(ids[None, :context], cache=cache))
    best = [float("inf")] * n_max
    for rep in range(repeats + 1):  # pass 0 only warms up
        for n in range(1, n_max + 1):
            tic = time.perf_counter()
            mx.eval(model(ids[None, context : context + n], cache=cache))
            if rep:
                best[n - 1] = min(best[n - 1], time.perf_counter() - tic)
            rollback(cache, n)
    for i in range(1, n_max):
        best[i] = max(best[i], best[i - 1])
    spent_once(time.perf_counter() - start)
    return best


def calibrate(model) -> list[float]:
    """Measure (again) and cache the verify times of `model` on this device."""
    return verify_seconds(model, recalibrate=True)
