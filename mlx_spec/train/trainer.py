"""The training loop: online target features, TTT loss, AdamW, checkpoints that resume exactly.

State of a run, all in the output folder:
* `train.json`        the run's settings (steps, learning rate, taps, seed, ...);
* `checkpoint.safetensors`  what resuming reads: the head's weights and AdamW's state, of
  one step (in its metadata), in one file written first;
* `config.json` + `model.safetensors`   the head so far (a loadable drafter);
* `state.json`        the number of optimizer steps done (written last).
Every file is replaced through a temporary name, so a run killed while saving
resumes from the checkpoint before, or from the one being written if its file was
complete. The data order is a function of (seed, epoch) only and
no random numbers are drawn while training, so a run stopped after any
checkpoint and resumed gives the same weights as one that never stopped.

The frozen target runs once per sequence, outside the differentiated
function, with taps installed (`mlx_spec.taps.Taps`); its features and
logits enter the loss as constants (`target_batch`). Sequences are capped at
`max_length` tokens, so memory is bounded by that and `steps`. What the
target computed for a sequence is kept for later epochs while it fits in
`feature_cache_gb` (the target's forward is then paid once per sequence, not
once per epoch); its logits are held in float16 whether kept or not, so a
run computes the same numbers with or without the cache.
"""

from __future__ import annotations

import math
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

from ..taps import Taps, decoder_stack, embedding
from .export import save_json, save_tensors, write_head
from .ttt import draft_index, loss_fn, target_batch


@dataclass
class Settings:
    """What a run does; saved as train.json and read back by --resume."""

    steps: int  # optimizer steps in the whole run (one sequence each)
    lr: float = 3e-4
    warmup: float = 0.05  # share of the steps spent warming up linearly
    weight_decay: float = 0.0
    clip: float = 0.5  # global gradient-norm clip (SpecForge's default)
    ttt_steps: int = 7
    seed: int = 0
    checkpoint_every: int = 200
    log_every: int = 10
    taps: list = field(default_factory=list)
    feature_cache_gb: float = 2.0  # target features kept across epochs (0: recompute every time)


def schedule(s: Settings):
    """Linear warm-up to `lr`, then cosine decay to zero over the remaining steps."""
    warm = max(1, int(round(s.warmup * s.steps)))
    rest = max(1, s.steps - warm)
    return optim.join_schedules([optim.linear_schedule(0.0, s.lr, warm), optim.cosine_decay(s.lr, rest)], [warm])


def order(n: int, seed: int, step: int) -> int:
    """Index of the sequence optimizer step `step` trains on: a fresh permutation each epoch."""
    epoch, i = divmod(step, n)
    return int(np.random.default_rng([seed, epoch]).permutation(n)[i])


CHECKPOINT = "checkpoint.safetensors"


class Trainer:
    """Trains `head` (an `Eagle3Head`) on `rows` against `model`; writes to `out`."""

    def __init__(self, model, head, config: dict, d2t: mx.array, rows: list[dict], out, settings: Settings,
                 log=None):
        self.model, self.head, self.config, self.rows = model, head, config, rows
        self.d2t = d2t.astype(mx.int32)
        self.out, self.s = Path(out), settings
        self.log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
        # The drafter's own choice (EagleDrafter.bind): the head's embedding if it has one.
        self.embed = head.embed_tokens if "embed_tokens" in head else embedding(decoder_stack(model))
        if "embed_tokens" in head:
            head.embed_tokens.freeze()  # the embedding stays as it is (SpecForge freezes it too)
        self.index = draft_index(self.d2t, config["vocab_size"])
        self.opt = optim.AdamW(learning_rate=schedule(settings), weight_decay=settings.weight_decay)
        self.opt.init(head.trainable_parameters())
        self.step = 0
        self._grad = nn.value_and_grad(head, self._loss)
        self._kept: dict[int, object] = {}  # sequence index -> its target Batch
        self._kept_bytes = 0

    def _loss(self, batch):
        return loss_fn(self.head, self.embed, batch, self.s.taps, self.s.ttt_steps)

    # ------------------------------------------------------------ checkpoints

    def save(self) -> None:
        meta = {"step": str(self.step)}
        both = {f"head/{k}": v for k, v in tree_flatten(self.head.trainable_parameters())}
        both.update({f"opt/{k}": v for k, v in tree_flatten(self.opt.state)})
        save_tensors(self.out / CHECKPOINT, both, meta)  # one file: a crash leaves one step's
        write_head(self.out, self.head, self.config, self.d2t, meta)
        save_json(self.out / "state.json", {"step": self.step, "steps": self.s.steps})

    def restore(self) -> None:
        """Continue from the folder's last checkpoint (head, optimizer, step)."""
        if not (self.out / CHECKPOINT).is_file():
            raise ValueError(f"{self.out} has no {CHECKPOINT} (a folder of mlx-spec before 2026-12-07, "
                             "which kept the optimizer in optimizer.safetensors): resume it with that "
                             "version, or start again in a new --out folder")
        both, meta = mx.load(str(self.out / CHECKPOINT), return_metadata=True)
        w = {k[5:]: v for k, v in both.items() if k.startswith("head/")}
        if set(w) != {k for k, _ in tree_flatten(self.head.trainable_parameters())}:
            raise ValueError(f"{self.out / CHECKPOINT} does not hold this head's trained weights: "
                             "start again in a new --out folder (or empty this one)")
        self.head.load_weights(list(w.items()), strict=False)  # a frozen embedding is not in it
        self.opt.state = tree_unflatten([(k[4:], v) for k, v in both.items() if k.startswith("opt/")])
        self.step = int(meta["step"])
        mx.eval(self.head.parameters(), self.opt.state)
        self.save()  # the loadable head and state.json as the checkpoint (a kill may have come between)

    # ------------------------------------------------------------ the loop

    def run(self, on_step=None) -> dict:
        """Train until `settings.steps`; returns the last logged figures. `on_step(step)` is
        called after each optimizer step (and its checkpoint, if one is due)."""
        s, n = self.s, len(self.rows)
        if n == 0:
            raise ValueError("no training sequences")
        taps = Taps(self.model, s.taps)
        self._started = self.step
        t0, toks, last = time.perf_counter(), 0, {}
        losses, accs = [], []
        try:
            while self.step < s.steps:
                batch = self._batch(order(n, s.seed, self.step), taps)
                (loss, acc), grads = self._grad(batch)
                grads, _ = optim.clip_grad_norm(grads, s.clip)
                self.opt.update(self.head, grads)
                mx.eval(self.head.parameters(), self.opt.state, loss, acc)
                self.step += 1
                toks += batch.tokens.shape[0]
                losses.append(loss.item())
                accs.append(np.array(acc))
                if self.step % s.checkpoint_every == 0 or self.step == s.steps:
                    self.save()
                if self.step % s.log_every == 0 or self.step == s.steps:
                    last = self._progress(losses, accs, toks, time.perf_counter() - t0)
                    losses, accs = [], []
                if on_step is not None:
                    on_step(self.step)
        finally:
            taps.remove()
        return last

    def _batch(self, i: int, taps):
        """The target's features and logits for sequence `i`: computed, or kept from before."""
        if i in self._kept:
            return self._kept[i]
        row = self.rows[i]
        b = target_batch(self.model, taps, row["tokens"], row["prompt_len"], self.d2t, self.index)
        b.target_logits = b.target_logits.astype(mx.float16)
        mx.eval(b.target_logits)
        size = sum(a.nbytes for a in (b.tokens, b.target_logits, b.target_top, *b.taps.values()))
        if self._kept_bytes + size <= self.s.feature_cache_gb * 2**30:
            self._kept[i], self._kept_bytes = b, self._kept_bytes + size
        return b

    def _progress(self, losses, accs, toks, dt) -> dict:
        s = self.s
        tps = toks / dt if dt else 0.0
        per_step = dt / max(1, self.step - self._started)
        eta = per_step * (s.steps - self.step)
        acc = np.mean(accs, axis=0) if accs else np.zeros(s.ttt_steps)
        lr = float(self.opt.learning_rate)
        self.log(f"step {self.step}/{s.steps} | loss {np.mean(losses):.3f} | top-1 agreement "
                 f"{' '.join(f'{a:.2f}' for a in acc)} | {tps:.0f} tok/s | lr {lr:.2e} | "
                 f"ETA {_clock(eta)}")
        return {"step": self.step, "loss": float(np.mean(losses)), "agreement": [float(a) for a in acc],
                "tokens_per_second": tps}


def _clock(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    m, sec = divmod(int(seconds), 60)
    h, m = divmod(m, 60)
    return f"{h}:{m:02d}:{sec:02d}"


def settings_dict(s: Settings) -> dict:
    return asdict(s)
