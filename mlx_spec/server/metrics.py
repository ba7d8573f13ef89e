"""Server counters, exposed at `/metrics` in the Prometheus text format.

The speculative-decoding counters use vLLM's names
(https://docs.vllm.ai/en/latest/usage/metrics.html: `spec_decode_num_drafts`,
`spec_decode_num_draft_tokens`, `spec_decode_num_accepted_tokens`,
`spec_decode_num_accepted_tokens_per_pos{position}`) under the `mlx_spec:`
prefix, so dashboards built for vLLM read them with the prefix changed. Every
total is the sum of the per-request figures the engine reported (`Usage`);
the text format is https://prometheus.io/docs/instrumenting/exposition_formats/.
"""

from __future__ import annotations

import threading
from collections import Counter

STATUSES = ("completed", "cancelled", "failed", "rejected", "invalid")
P = "mlx_spec:"


class Metrics:
    """Totals over the server's life; updated by the engine thread and the handlers."""

    def __init__(self):
        self._lock = threading.Lock()
        self.requests = Counter({s: 0 for s in STATUSES})
        self.prompt_tokens = self.cached_tokens = self.generation_tokens = 0
        self.drafts = self.draft_tokens = self.accepted_tokens = 0
        self.accepted_per_pos: list[int] = []
        self.batch_steps: Counter = Counter()  # decode steps by the number of rows verified

    def request_done(self, status: str, usage=None) -> None:
        with self._lock:
            self.requests[status] += 1
            if usage is None:
                return
            self.prompt_tokens += usage.prompt_tokens
            self.cached_tokens += usage.cached_tokens
            self.generation_tokens += usage.completion_tokens
            s = usage.stats
            if usage.drafter is None or s is None:
                return
            self.drafts += s.drafts
            self.draft_tokens += s.drafted
            self.accepted_tokens += s.accepted
            per_pos = s.accepted_at_position
            self.accepted_per_pos += [0] * (len(per_pos) - len(self.accepted_per_pos))
            for i, a in enumerate(per_pos):
                self.accepted_per_pos[i] += a

    def batch_step(self, rows: int) -> None:
        with self._lock:
            self.batch_steps[rows] += 1

    def render(self, running: int, waiting: int, model_id: str) -> str:
        with self._lock:
            out: list[str] = []

            def metric(name, kind, help_, samples):
                out.append(f"# HELP {P}{name} {help_}")
                out.append(f"# TYPE {P}{name} {kind}")
                for labels, value in samples:
                    out.append(f"{P}{name}{labels} {value}")

            model = f'model_name="{_escape(model_id)}"'
            one = lambda v: [(f"{{{model}}}", v)]  # noqa: E731
            metric("spec_decode_num_drafts_total", "counter",
                   "Verify steps that drafted at least one token.", one(self.drafts))
            metric("spec_decode_num_draft_tokens_total", "counter",
                   "Draft tokens verified by the target.", one(self.draft_tokens))
            metric("spec_decode_num_accepted_tokens_total", "counter",
                   "Draft tokens the target kept.", one(self.accepted_tokens))
            metric("spec_decode_num_accepted_tokens_per_pos_total", "counter",
                   "Draft tokens kept, by position in the draft (0 = first).",
                   [(f'{{{model},position="{i}"}}', a) for i, a in enumerate(self.accepted_per_pos)])
            metric("prompt_tokens_total", "counter", "Prompt tokens of finished requests "
                   "(cached ones included).", one(self.prompt_tokens))
            metric("prompt_tokens_cached_total", "counter",
                   "Prompt tokens served from the prompt cache.", one(self.cached_tokens))
            metric("generation_tokens_total", "counter", "Tokens generated.",
                   one(self.generation_tokens))
            metric("requests_total", "counter", "Requests by how they ended.",
                   [(f'{{{model},status="{s}"}}', self.requests[s]) for s in STATUSES])
            metric("decode_steps_total", "counter", "Decode steps by the number of requests "
                   "verified together in one forward (the batch size distribution).",
                   [(f'{{{model},rows="{b}"}}', c) for b, c in sorted(self.batch_steps.items())])
            metric("requests_running", "gauge", "Requests being decoded.", one(running))
            metric("requests_waiting", "gauge", "Requests waiting in the queue.", one(waiting))
            return "\n".join(out) + "\n"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
