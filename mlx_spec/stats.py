"""Speculative-decoding statistics: what a user needs to see why it is (not) faster."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class StepTrace:
    """One verify step: what was proposed and how much of it the target kept."""

    proposed: list[int]
    accepted: int
    k: int = 0  # the draft length asked for (the drafter may propose fewer)
    expected_gain: float | None = None  # the adaptive policy's estimate, vs plain decoding


@dataclass
class SpecStats:
    prompt_tokens: int = 0
    prompt_tps: float = 0.0
    generation_tokens: int = 0
    generation_tps: float = 0.0
    peak_memory: float = 0.0  # GB
    target_forwards: int = 0  # verify forwards after the prefill
    drafted: int = 0  # draft tokens verified (with a confidence cut: all rows fed, examined or not)
    accepted: int = 0
    step_seconds: float = 0.0  # wall time of the verify steps (propose .. commit)
    sync_seconds: float = 0.0  # of which spent waiting for MLX to evaluate the step's graph
    chosen_k: list[int] = field(default_factory=list)  # draft length chosen at each verify step
    batch_sizes: list[int] = field(default_factory=list)  # rows verified together at each step
    tree_steps: int = 0  # verify steps whose draft was a tree (verified whole)
    # Why the request stopped drafting for good, if it did: "backlog" when its drafter's first
    # read of the prompt would have cost more than drafting could save in the tokens left.
    plain_reason: str | None = None
    trace: list[StepTrace] | None = None
    _pos_drafted: list[int] = field(default_factory=list, repr=False)
    _pos_accepted: list[int] = field(default_factory=list, repr=False)
    _no_bonus: int = field(default=0, repr=False)  # steps that ended at a kept draft (an EOS): no bonus token

    def observe(self, proposed: list[int], n: int, keep_trace: bool, chosen: int = 0,
                gain: float | None = None, size: int | None = None, bonus: bool = True) -> None:
        """One verify step: `chosen` tokens asked for, `size` drafted and verified (default:
        `len(proposed)`), `proposed` examined (a confidence cut may examine fewer), n kept, and
        whether the target's own token followed them (not when the last kept draft was an EOS)."""
        self.chosen_k.append(chosen)
        self._no_bonus += not bonus
        k = len(proposed) if size is None else size
        self.target_forwards += 1
        self.drafted += k
        self.accepted += n
        grow = k - len(self._pos_drafted)
        if grow > 0:
            self._pos_drafted += [0] * grow
            self._pos_accepted += [0] * grow
        for i in range(k):
            self._pos_drafted[i] += 1
            self._pos_accepted[i] += i < n
        if keep_trace:
            if self.trace is None:
                self.trace = []
            self.trace.append(StepTrace(proposed, n, chosen, gain))

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def step_tokens(self) -> int:
        """Tokens the verify steps emitted: n + 1 a step, n at a step ended by a drafted EOS."""
        return self.accepted + self.target_forwards - self._no_bonus

    @property
    def tau(self) -> float:
        """Tokens emitted per verify forward (`step_tokens` over the forwards)."""
        f = self.target_forwards
        return self.step_tokens / f if f else 0.0

    @property
    def host_overhead(self) -> float:
        """Share of the step time spent in Python (building graphs, bookkeeping)."""
        return 1 - self.sync_seconds / self.step_seconds if self.step_seconds else 0.0

    @property
    def host_ms_per_step(self) -> float:
        """Milliseconds of each step during which MLX had none of the step's work queued
        (building the graph up to its first queued piece, bookkeeping after the result is
        read), on average. It cannot see a fast device running dry between queued pieces."""
        f = self.target_forwards
        return 1000 * (self.step_seconds - self.sync_seconds) / f if f else 0.0

    @property
    def accepted_per_position(self) -> list[float]:
        return [a / d for a, d in zip(self._pos_accepted, self._pos_drafted)]

    @property
    def drafted_at_position(self) -> list[int]:
        """How many verify steps drafted a token at each position (counts, not rates)."""
        return list(self._pos_drafted)

    @property
    def accepted_at_position(self) -> list[int]:
        """How many verify steps kept the draft at each position (vLLM's per-position count)."""
        return list(self._pos_accepted)

    @property
    def drafts(self) -> int:
        """Verify steps that drafted at least one token (vLLM's `num_drafts`)."""
        return self._pos_drafted[0] if self._pos_drafted else 0

    def summary(self) -> str:
        return (
            f"prompt {self.prompt_tokens} tok @ {self.prompt_tps:.1f} tok/s | "
            f"generation {self.generation_tokens} tok @ {self.generation_tps:.2f} tok/s | "
            f"tau {self.tau:.2f} | acceptance {self.acceptance_rate:.1%} "
            f"({self.accepted}/{self.drafted}) | peak memory {self.peak_memory:.2f} GB"
        )
