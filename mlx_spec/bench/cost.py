"""The verify cost curve: how much a target forward over n tokens costs relative to n = 1.

Speculative decoding pays one forward over `[y, d0 .. d(k-1)]` (n = k + 1
tokens) per step. If that forward cost as much as a one-token step, every
accepted token would be free; on real hardware it grows with n (compute-bound
CPUs more than bandwidth-bound GPUs), and the best k is where the extra
accepted tokens stop paying for the wider forward. The measurement itself is
the adaptive policy's calibration (`mlx_spec.calibration.measure_verify_seconds`),
so the benchmark reports exactly the curve `auto` plans with.
"""

from __future__ import annotations

from typing import Sequence


def verify_times(model, n_max: int = 16, context: int = 256, repeats: int = 3) -> list[float]:
    """Seconds of one target forward over n = 1..n_max tokens after `context` cached tokens.

    The fastest of `repeats` timed passes at each n (interference only adds time);
    `times[n - 1]` is the block of n tokens. A wider block may cost less.
    """
    from ..calibration import measure_verify_seconds

    if n_max < 1 or context < 1 or repeats < 1:
        raise ValueError("n_max, context and repeats must all be >= 1")
    return measure_verify_seconds(model, n_max=n_max, context=context, repeats=repeats)


def verify_cost_curve(model, n_max: int = 16, context: int = 256, repeats: int = 3) -> list[float]:
    """T(n)/T(1) for n = 1..n_max (`curve[0] == 1.0`); see `verify_times`."""
    return relative(verify_times(model, n_max, context, repeats))


def relative(times: Sequence[float]) -> list[float]:
    """Times divided by the first one."""
    return [t / times[0] for t in times]
