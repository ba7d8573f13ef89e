"""Handing a loaded model to another thread (the server's engine thread).

MLX (0.32) keeps its streams per thread: an array made by an operation on one thread
belongs to that thread's stream, and evaluating it while it is still lazy on another
thread fails with `RuntimeError: There is no Stream(cpu, 0) in current thread`. Weights
are evaluated at load, but a model may hold other lazy arrays: mlx-vlm's DeepSeek-V4
computes each RoPE's frequencies (`_freqs`, a private attribute, so not among the
`parameters()`) when the model is built, in the attention, the KV compressors and the
indexer's compressor; the compressors' ones are read only once a pool fills, so a short
warm-up passes and a later request fails. `materialize` evaluates every array reachable
from the objects it is given, private ones included, on the calling thread.
"""

from __future__ import annotations

import types

import mlx.core as mx
import mlx.nn as nn

_SKIP = (types.ModuleType, types.FunctionType, types.BuiltinFunctionType, types.MethodType, type,
         str, bytes, int, float, bool, type(None))
STREAM_ERROR = "There is no Stream("


def arrays(*objs, depth: int = 4) -> list:
    """Every `mx.array` reachable from `objs`: through modules (all their entries, private
    ones such as `_freqs` included), lists, tuples and dicts without limit, and through the
    attributes of other objects (a drafter, a cache) up to `depth` levels."""
    found, seen = [], set()

    def walk(obj, level):
        if id(obj) in seen or isinstance(obj, _SKIP) or level > depth:
            return
        seen.add(id(obj))
        if isinstance(obj, mx.array):
            found.append(obj)
            return
        if isinstance(obj, dict):  # nn.Module is a dict of its children and arrays
            for v in obj.values():
                walk(v, level)
        elif isinstance(obj, (list, tuple)):
            for v in obj:
                walk(v, level)
        if hasattr(obj, "__dict__"):
            for v in vars(obj).values():
                walk(v, level if isinstance(obj, nn.Module) else level + 1)

    for obj in objs:
        walk(obj, 0)
    return found


def materialize(*objs) -> None:
    """Evaluate, on this thread, every array `objs` hold (see `arrays`), so that another
    thread can use them."""
    mx.eval(arrays(*objs))


def explain(error: BaseException) -> BaseException:
    """`error`, with what it means when MLX found an array of another thread's stream."""
    if isinstance(error, RuntimeError) and STREAM_ERROR in str(error):
        return RuntimeError(f"{error} (an array made lazily on another thread, e.g. while "
                            "loading, reached the engine thread: MLX streams belong to one "
                            "thread; evaluate it before starting the engine, e.g. with "
                            "mlx_spec.handover.materialize)")
    return error
