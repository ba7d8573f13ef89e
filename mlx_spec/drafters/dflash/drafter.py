"""DFlashDrafter: one block forward proposes up to B-1 tokens (B = 16 for published heads).

Per step the drafter embeds `[y, mask x (B-1)]` with the TARGET's token embeddings, as
Hugging Face's `embed_tokens` returns them (Gemma's scaled by sqrt(H), no embedding norm;
y = the newest committed token, not yet consumed by the target, at position p = the
committed length) and runs the block network once; block row
j >= 1 predicts the token at position p + j, i.e. d[j-1]. Logits come from the
target's LM head (times `output_multiplier`, then `softcap * tanh(l / softcap)`
when the head config sets them, as Muse Glimmer does).

Greedy: argmax tokens, q = None. Sampling: by default (`sample_drafts=True`)
each d[j] is drawn from q_j = `sampling.probs(logits_j)`; with
`sample_drafts=False` the argmax tokens are checked as point masses (q = None).
Both are lossless: the block never looks at the drafted tokens, so q_j is the
proposal's true distribution at every position whatever was drafted before it.
Drawn drafts are the default, as for DSpark, because they accept more: a draw
from q_j is accepted with probability sum_x min(p_j, q_j) = 1 - TV(p_j, q_j), an
argmax with p_j(argmax q_j), which is lower wherever the target is unsure. Argmax
wins only when nearly every position is near-deterministic, where the block stays
on one branch (`scripts/block_draft_modes.py` measures both on exact marginals).

Trees (`tree_budget=N`): the same block forward, then a DDTree of the N most likely
prefixes under the block's per-position distributions, depth <= k (`block_tree`); its
nodes are point masses. Reading the [k, N] top-N table costs one host sync in `propose`
(the verify's own is the other). A target whose cache cannot verify a tree (recurrent or
sliding-window layers) gets chains instead. DFlash2's candidate selector scores each
row's candidates given the token before them, so its tree is the N most likely paths of
that chain (`CandidateSelector.tree`, through `dynamic_tree.best_paths` as DSpark's Markov trees).

Invariant: the context cache holds exactly the committed positions. `prefill`
and `commit` append the taps of the tokens the target kept, so block K/V from a
proposal never need to be rolled back. `propose` is lazy (no host sync) when it drafts
chains.
"""

from __future__ import annotations

from typing import Sequence

import mlx.core as mx

from ...sampling import Sampling
from ...taps import decoder_stack, embedding, embedding_scale
from ..base import MAX_DRAFT, RECONVERT, Draft, SavesState, check_target, pick_block, target_lm_head
from ..block_tree import check_budget, propose_tree, tree_verifiable
from .net import BlockConfig, BlockContext, DFlashNet


def check_block_target(model, cfg: BlockConfig, taps: tuple, what: str, vocab: int | None = None) -> None:
    """Refuse a target the block head does not fit: it embeds `[y, mask ...]` with the
    target's own embeddings (so the widths must agree), reads its layer taps (as wide as its
    embeddings), and a DFlash2 head's codebooks have a row per token of the target's vocabulary."""
    if cfg.target_hidden_size != cfg.hidden_size:
        raise ValueError(f"{what} reads target layers {cfg.target_hidden_size} wide but embeds with a "
                         f"{cfg.hidden_size}-wide target embedding: its config.json is damaged; {RECONVERT}")
    check_target(model, what, hidden_size=cfg.hidden_size, vocab=vocab if vocab is not None else cfg.vocab_size or None,
                 layers=taps, token_ids={"mask_token_id": cfg.mask_token_id})


def block_inputs(y: int, cfg: BlockConfig) -> mx.array:
    """[y, mask x (B-1)] as ids [B]."""
    return mx.array([y] + [cfg.mask_token_id] * (cfg.block_size - 1), dtype=mx.uint32)


class DFlashDrafter(SavesState):
    """DFlash block drafter over a target model; taps are layer outputs (mlx_spec.taps)."""

    STATE = ("context.caches",)  # committed state (SavesState)

    def __init__(
        self,
        net: DFlashNet,
        cfg: BlockConfig,
        taps: Sequence,
        *,
        output_multiplier: float = 1.0,
        softcap: float | None = None,
        sample_drafts: bool = True,
        tree_budget: int | None = None,
    ):
        if cfg.block_size < 2:
            raise ValueError(f"a DFlash block needs at least 2 rows, got block_size {cfg.block_size}")
        self.cfg, self.taps = cfg, tuple(taps)
        self.max_draft = min(cfg.block_size - 1, MAX_DRAFT)
        self.output_multiplier, self.softcap = output_multiplier, softcap
        self.sample_drafts = sample_drafts
        self.context = BlockContext(net, cfg, self.taps)
        self.tree_budget = check_budget(tree_budget)
        self._trees = False  # set by bind: a tree_budget and a target that can verify trees
        self._embed = self._head = None
        self._embed_scale = 1.0

    def bind(self, model, tokenizer) -> None:
        check_block_target(model, self.cfg, self.taps, "this DFlash head")
        stack = decoder_stack(model)
        # The target's token embedding as Hugging Face's `embed_tokens` returns it: Gemma's is a
        # scaled word embedding (x sqrt(H)); no embedding norm (Muse Glimmer applies one after
        # its raw embedding: not used here).
        self._embed, self._embed_scale = embedding(stack), embedding_scale(stack)
        self._head = target_lm_head(model)
        self._trees = self.tree_budget is not None and tree_verifiable(model)
        self.context.reset()

    def prefill(self, tokens: Sequence[int], taps: dict | None) -> None:
        self.context.add(taps, len(tokens))

    def logits(self, h: mx.array) -> mx.array:
        """Block hidden rows [k, H] -> logits over the target vocabulary [k, V]."""
        out = self._head(h)
        if self.output_multiplier != 1.0:
            out = out * self.output_multiplier
        if self.softcap:
            out = mx.tanh(out / self.softcap) * self.softcap
        return out

    def hidden(self, y: int) -> mx.array:
        """The block forward for anchor y: h [B, H] (lazy)."""
        if self._embed is None:
            raise RuntimeError("bind(model, tokenizer) the drafter before using it")
        x = self._embed(block_inputs(y, self.cfg))
        scale = self.cfg.input_embedding_scale * self._embed_scale
        if scale != 1.0:
            x = x * scale
        return self.context.forward(x)

    def propose(self, y: int, k: int, sampling: Sampling) -> Draft:
        k = min(k, self.max_draft)
        # Always the full block: the mask rows shape each other's predictions.
        h = self.hidden(y)[1 : k + 1]  # [k, H]
        selector = self.context.net.candidate_selector if "candidate_selector" in self.context.net else None
        if self._trees:
            if selector is not None:  # DFlash2: the best paths through the rows' top-k
                return selector.tree(h, self.logits(h), y, sampling, self.tree_budget)
            return propose_tree(self.logits(h), sampling, self.tree_budget)
        if selector is not None:  # DFlash2: a path through each row's top-k
            return selector.choose(h, self.logits(h), y, sampling, self.sample_drafts)
        return pick_block(self.logits(h), sampling, self.sample_drafts)

    def commit(self, tokens: Sequence[int], taps: dict | None) -> None:
        self.context.add(taps, len(tokens))
