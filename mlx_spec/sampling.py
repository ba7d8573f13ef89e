"""The sampling distribution: logits -> the probabilities mlx-lm's sampler draws from.

mlx-lm's `make_sampler` filters log-probabilities (top-p, then min-p, then top-k)
*before* dividing by the temperature, then draws from the softmax of what is
left. Rejection sampling is only lossless when `p` (target) and `q` (draft) are
exactly those distributions, so both come from `Sampling.probs`, which reuses
mlx-lm's own filter functions in mlx-lm's own order.

Probabilities are computed in float32 whatever the model's dtype: bf16
probabilities are off by up to ~0.4% each, and `max(p - q, 0)` of two such rows
is mostly rounding noise where p and q agree. Only k + 1 rows are converted.
As in mlx-lm, `top_p` 0 or 1 means no nucleus filter and `top_k` 0 none.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p


@dataclass(frozen=True)
class Sampling:
    """Decoding settings; `temp == 0` means greedy (argmax)."""

    temp: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0

    def __post_init__(self):
        for name in ("temp", "top_p", "min_p"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise ValueError(f"{name} must be a number, got {v!r}")
        if not self.temp >= 0:
            raise ValueError(f"temp must be >= 0, got {self.temp}")
        if not 0 <= self.top_p <= 1:
            raise ValueError(f"top_p must be in [0, 1] (0 or 1: off), got {self.top_p}")
        if not (isinstance(self.top_k, int) and self.top_k >= 0):
            raise ValueError(f"top_k must be an integer >= 0, got {self.top_k!r}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")

    @property
    def greedy(self) -> bool:
        return self.temp == 0

    def probs(self, logits: mx.array) -> mx.array:
        """Filtered, tempered distribution over the last axis: [..., V] -> [..., V].

        Only meaningful for `temp > 0`; greedy decoding uses argmax directly.
        """
        logits = logits.astype(mx.float32)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        if 0.0 < self.top_p < 1.0:
            logprobs = apply_top_p(logprobs, self.top_p)
        if self.min_p > 0.0:
            logprobs = apply_min_p(logprobs, self.min_p)
        if 0 < self.top_k < logprobs.shape[-1]:
            logprobs = apply_top_k(logprobs, self.top_k)
        return mx.softmax(logprobs * (1.0 / self.temp), axis=-1, precise=True)

    def sample(self, logits: mx.array) -> mx.array:
        """One token per row of `logits`, drawn as mlx-lm would (argmax when greedy)."""
        if self.greedy:
            return greedy_tokens(logits)
        return mx.random.categorical(mx.log(self.probs(logits)))


def greedy_tokens(logits: mx.array) -> mx.array:
    """The target's greedy token per row, picked as mlx-lm's `generate_step` does: the argmax of
    the log-probabilities in the logits' own dtype (logits - logsumexp). In bfloat16 that
    rounding can tie tokens the raw logits tell apart, and the argmax then takes the lower id,
    so an argmax of the raw logits would not be mlx-lm's text."""
    return mx.argmax(logits - mx.logsumexp(logits, axis=-1, keepdims=True), axis=-1)
