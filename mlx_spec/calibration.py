"""The target's verify cost curve: seconds of a forward over n tokens, measured once per model.

A forward over n tokens after a 128-token context is timed for n = 1..N_MAX (the
fastest of a few interleaved passes), cached on disk per model architecture,
weights' dtype, device and MLX version, and on Linux's CPU backend the BLAS in use
(`model_key`), and read back by every later process. The adaptive draft-length policy (`mlx_spec.adaptive`) and a
batch's choice of draft length (`mlx_spec.batch_policy`) weigh tokens against
these seconds.

The curve is not forced to grow with n: on this project's CPU (OpenBLAS, float32) a
16-token forward of Qwen2.5-Coder-1.5B took 0.77 s against 1.50 s for 12 tokens and 0.48 s
for one, and a lone request's chain runs at the cheapest width that saves a tenth
(`adaptive.CostModel.padded`). A curve measured while other work shared the machine is
dearer than the machine, and not evenly across n, so `auto` would choose its lengths from
wrong costs for as long as the curve is kept. Two guards: each n is the fastest of
several interleaved passes, so a slow pass at one n stays at that n; and when a request's
steps took well under the curve's time for their forward alone (`suspect`), the curve is
set aside and the next process measures it again, keeping for each n the faster of the two.
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
    """Identity of (model architecture and weights' dtype, device, MLX version, and on Linux's
    CPU backend the BLAS its matmuls call).

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
    blas = _blas() if "cpu" in ident["device"] else None
    if blas is not None:  # (absent elsewhere: keys made before it stay valid on Macs)
        ident["blas"] = blas
    shard = getattr(model, "_mlx_spec_shard", None)
    if shard is not None:  # a sharded forward's cost includes its messages
        ident["shard"] = [shard.mode, shard.size, shard.rank]
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:16]


_BLAS: list = []  # [the BLAS this process's matmuls call], found once


def _blas() -> str | None:
    """On Linux, the BLAS MLX's CPU matmuls resolve to: the mlx[cpu] wheel's reference BLAS
    runs them about 20x slower than a preloaded OpenBLAS, with a curve of another shape, so a
    curve measured under one is never used under the other. None elsewhere."""
    if not _BLAS:
        name = None
        if platform.system() == "Linux":
            from .bench.hardware import detect_blas

            try:
                name = detect_blas(Path("/proc/self/maps").read_text())["name"]
            except OSError:
                pass
        _BLAS.append(name)
    return _BLAS[0]


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
        times = measure_verify_seconds(model, max(n_max, len(_CURVES.get(key, ()))))
        set_aside = None if recalibrate else _read_curve(_stale_path(key))  # (`suspect`)
        if set_aside is not None and len(set_aside) >= len(times):  # interference only adds time
            times = [min(a, b) for a, b in zip(times, set_aside)]
        return times

    times = agreed_curve(model, known, measure)  # a sharded target's ranks agree on it
    if times is not known:
        again = not recalibrate and _stale_path(key).exists()
        _write_curve(cache_dir() / f"{key}.json", times, measured_again=again)
        try:
            _stale_path(key).unlink(missing_ok=True)
        except OSError:
            pass
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


def _stale_path(key: str) -> Path:
    return cache_dir() / f"{key}.stale.json"


# Steps at one k that took less than this share of the target's forward alone (plain steps,
# which are pipelined and so hide their host work; steps that drafted, which also drafted)
# over at least SUSPECT_STEPS of them: the curve was measured while the machine was busier.
SUSPECT_PLAIN, SUSPECT_DRAFTED, SUSPECT_STEPS = 0.6, 0.8, 8


def suspect(model, witness: dict) -> bool:
    """Whether this model's cached curve was measured while the machine was busier than now,
    judged from timed decode steps: `witness[k]` = [steps that verified k drafts, the sum of
    each one's seconds over the curve's forward of k + 1 tokens]. When the steps at some k
    took on average less than that forward alone (`SUSPECT_PLAIN`, `SUSPECT_DRAFTED`), the
    curve is too dear. Then it is set aside: this process keeps it, the next one measures
    again (keeping, per n, the faster of the two), once: a curve measured again is kept.
    True when it was set aside."""
    slow = [(k, total / n) for k, (n, total) in sorted(witness.items())
            if n >= SUSPECT_STEPS and total / n < (SUSPECT_DRAFTED if k else SUSPECT_PLAIN)]
    if not slow:
        return False
    key = model_key(model)
    path = cache_dir() / f"{key}.json"
    try:
        if json.loads(path.read_text()).get("measured_again"):
            return False
        path.replace(_stale_path(key))
    except (OSError, ValueError, AttributeError):
        return False  # not cached on disk (or already set aside by another request)
    k, ratio = slow[0]
    log.info("steps verifying %d drafts took %.0f%% of the calibrated forward alone: the verify "
             "cost curve was measured while the machine was busier; it is measured again in "
             "the next process (%s)", k, 100 * ratio, path)
    return True


def write_json(path: Path, data) -> None:
    """Write `data` to `path` whole or not at all (a temporary file, then a rename), so a
    reader in another process never sees half of it. Raises OSError when it cannot."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp")  # (writers in threads too)
    tmp.write_text(json.dumps(data))
    tmp.replace(path)


def _write_curve(path: Path, times: list[float], measured_again: bool = False) -> None:
    try:
        write_json(path, {"verify_seconds": times, **({"measured_again": True} if measured_again else {})})
    except OSError as e:
        log.warning("cannot write the calibration cache %s (%s); keeping it in memory "
                    "for this process (set MLX_SPEC_CACHE to a writable folder)", path, e)


_ONCE = [0.0, 0.0]  # seconds this process spent inside steps on work not the step's own; of them, measuring


def one_time_seconds() -> float:
    """Seconds spent so far inside decode steps on one-time work: measuring cost curves (a
    batch met a new width) and a draft model reading its backlog (the prompt) before its
    first draft. A step subtracts them from the time it learns its shape's cost from."""
    return _ONCE[0]


def measuring_seconds() -> float:
    """Of `one_time_seconds`, those spent measuring cost curves: once per model and machine
    (then cached on disk), never a request's own work, so its generation speed leaves them out
    (a draft model's backlog read is the request's own, as a prompt's reading is)."""
    return _ONCE[1]


def spent_once(seconds: float, measuring: bool = False) -> None:
    _ONCE[0] += seconds
    _ONCE[1] += seconds if measuring else 0.0


def measure_verify_seconds(model, n_max: int = N_MAX, context: int = 128, repeats: int = 3) -> list[float]:
    """Seconds of a forward over n = 1..n_max tokens after `context` cached tokens.

    The fastest of `repeats` interleaved passes at each n (interference only ever adds
    time; `fastest`). Not forced to grow with n: a wider block can cost less (module
    docstring).
    """
    import time

    import mlx.core as mx

    start = time.perf_counter()

    from .cache import make_cache, rollback
    from .drafters.base import vocab_size

    cache = make_cache(model)
    ids = (mx.arange(context + n_max) * 7919 + 3) % vocab_size(model)  # any valid tokens
    mx.eval(model(ids[None, :context], cache=cache))
    passes = []
    for rep in range(repeats + 1):  # pass 0 only warms up
        times = []
        for n in range(1, n_max + 1):
            tic = time.perf_counter()
            mx.eval(model(ids[None, context : context + n], cache=cache))
            times.append(time.perf_counter() - tic)
            rollback(cache, n)
        passes += [times] if rep else []
    spent_once(time.perf_counter() - start, measuring=True)
    return fastest(passes)


def fastest(passes: list[list[float]]) -> list[float]:
    """Per n, the fastest of the passes' times."""
    return [min(times) for times in zip(*passes)]


def calibrate(model) -> list[float]:
    """Measure (again) and cache the verify times of `model` on this device."""
    return verify_seconds(model, recalibrate=True)
