"""The Drafter over DeepSeek-V4's DSpark stages: context per commit, one block per proposal.

Invariant: `StageContext` holds each stage's K/V for exactly the last `window`
committed positions, so nothing a proposal computes is ever kept or rolled
back. The anchor y sits at position p = the committed length; the block
`[y, noise x (B-1)]` fills positions p .. p+B-1 and row j drafts d_j (position
p+j+1): anchor-as-first-prediction, B rows give B drafts. The Markov chain, the
confidences and the cut are DSpark's (`SparkChain`), unchanged.
"""

from __future__ import annotations

from typing import Sequence

import mlx.core as mx

from ...taps import EMBED, decoder_stack, embedding
from ..base import MAX_DRAFT, SAME_WEIGHTS, SavesState, check_target, target_lm_head
from ..spark_chain import SparkChain, SparkConfig
from .net import DSparkStages, StageContext


def tap_ids(layer_ids: Sequence[int], variant: str) -> tuple:
    """dspark_target_layer_ids -> mlx-spec taps (tap k = the output of layer k).

    V4.1 reads the streams entering layer l (tap l-1, the embedding for l = 0);
    V4-Flash-0731 reads the streams leaving layer l (tap l). See docs/dflash.md.
    """
    if variant == "0731":
        return tuple(int(l) for l in layer_ids)
    return tuple(EMBED if int(l) == 0 else int(l) - 1 for l in layer_ids)


class V4DSparkDrafter(SparkChain, SavesState):
    """Drafts up to `block_size` tokens per step with the target's own DSpark stages."""

    STATE = ("context.rows", "context.end")  # committed state (SavesState)

    def __init__(self, net: DSparkStages, spark: SparkConfig, layer_ids: Sequence[int], *,
                 block_size: int, noise_token_id: int, window: int,
                 confidence_threshold: float | None = None, cut: str = "sync",
                 sample_drafts: bool = True):
        self.net, self.heads, self.spark = net, net, spark
        self.layer_ids = tuple(int(l) for l in layer_ids)
        self.taps = tap_ids(self.layer_ids, net.variant)
        self.noise_token_id = noise_token_id
        self.set_block(block_size)
        self.sample_drafts = sample_drafts
        self.set_cut(confidence_threshold, cut)
        self.context = StageContext(net, window)
        self._embed = self._head = None

    def set_block(self, rows: int) -> None:
        """Propose from blocks of `rows` rows `[y, noise x (rows-1)]`: up to `rows` drafts.

        The stages were trained on `dspark_block_size` rows; vLLM's
        `"num_speculative_tokens": N` runs N rows whatever that size (the V4-Flash-0731
        model card uses N = 7 with a block size of 5), and so does this."""
        if not 1 <= int(rows) <= MAX_DRAFT:
            raise ValueError(f"a DSpark block has 1..{MAX_DRAFT} rows, got {rows}")
        self.block_size = int(rows)
        self.max_draft = self.block_size

    def bind(self, model, tokenizer) -> None:
        # dspark_target_layer_ids are decoder layers (their input for V4.1), so check those
        check_target(model, "these DeepSeek-V4 DSpark stages", SAME_WEIGHTS,
                     hidden_size=self.net.args.hidden_size, vocab=self.spark.vocab_size,
                     layers=self.layer_ids, token_ids={"dspark_noise_token_id": self.noise_token_id})
        self._embed, self._head = embedding(decoder_stack(model)), target_lm_head(model)
        self.context.reset()

    def _add(self, taps: dict | None, n: int) -> None:
        if taps is None:
            raise ValueError("the DeepSeek-V4 DSpark drafter needs the target's taps")
        # A tap is the hc streams [T, hc, H]; the stages read their mean.
        feats = mx.concatenate([taps[t].mean(axis=1) for t in self.taps], axis=-1)
        if feats.shape[0] != n:
            raise ValueError(f"got taps for {feats.shape[0]} positions, expected {n}")
        self.context.add(feats)

    def prefill(self, tokens: Sequence[int], taps: dict | None) -> None:
        self._add(taps, len(tokens))

    def commit(self, tokens: Sequence[int], taps: dict | None) -> None:
        self._add(taps, len(tokens))

    def block_inputs(self, y: int) -> mx.array:
        return mx.array([y] + [self.noise_token_id] * (self.block_size - 1), dtype=mx.uint32)

    def step_logits(self, y: int, k: int) -> tuple[mx.array, mx.array]:
        """Parallel stage: (base logits U [k, V], pre-norm rows h [k, H]) for anchor y."""
        if self._embed is None:
            raise RuntimeError("bind(model, tokenizer) the drafter before using it")
        x = self._embed(self.block_inputs(y))[None]
        h, normed = self.net(x, self.context.rows, self.context.end)  # the whole block runs
        return self._head(normed[:k]), h[:k]
