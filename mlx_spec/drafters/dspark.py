"""DSpark (DeepSeek DeepSpec): DFlash's parallel block, a Markov head, a confidence cut.

One step, for anchor y at position p (the committed length) and a block of B rows:

    h   = block forward of [y, mask x (B-1)]   # DFlash's network, called (composition)
    U   = lm_head(h)                            # [B, V]; row j predicts d_j (position p+j+1)
    s_j = U_j + W2 W1[x_{j-1}]                  # Markov bias, x_{-1} = y, x_j = d_j
    d_j = argmax s_j (greedy)  |  d_j ~ q_j = probs(s_j) (sampling, default: see below)
    c_j = sigmoid(w . [h_j ; W1[x_{j-1}]] + b)  # P(d_j survives | d_<j survived)
    L   = #{leading j : a_j = c_0 c_1 ... c_j >= threshold}

Anchor-as-first-prediction: unlike DFlash, every block row drafts, so B rows give
B tokens. q_j is conditioned on d_<j (left to right), which rejection sampling
allows. Drawing (`sample_drafts=True`, the default for every block drafter) accepts
with probability 1 - TV(p_j, q_j) per position against p_j(argmax q_j) for argmax
drafts (see `dflash.drafter`), and the Markov term keeps a drawn block on the
branch its earlier tokens took. The cut is non-anticipating: c_j depends on h_j
and d_(j-1), never on d_j, so whether d_j is verified does not depend on its own
value, and conditioned on being verified d_j is still distributed as q_j: lossless.

The cut without a host sync (`cut="mask"`; the default is `"sync"`, below):
propose returns all k tokens plus a lazy `length` L, and the verifier must mask
its acceptance. For target probabilities p_0 .. p_k, drafts d_0 .. d_(k-1):

    accept d_i (i < L) with probability min(1, p_i(d_i) / q_i(d_i))   (q = 1 for a point mass)
    n    = first rejected i < L, else L               # tokens at i >= L are never examined
    next ~ normalize(max(p_n - q_n, 0))  if n < L     # the usual residual
    next ~ p_L                           if n = L     # NOT the residual: d_L was never proposed
    greedy: n = min(n_greedy, L), next = argmax p_n

Row L of the verify forward saw only [y, d_<L], so this is exactly rejection
sampling of the L-token draft; the core's `mlx_spec.acceptance.accept` does it
for any `Draft.length`. With `cut="mask"` the whole block is still verified
(the cut lowers nothing but the accepted count); `cut="sync"` instead reads L on
the host inside propose (one extra host sync per step) and returns only L
tokens, so the verify forward really shrinks.

DeepSeek-V4's in-checkpoint DSpark stages (`mtp.*`, `probe_target`) live in
`dspark_v4`; both drafters take the Markov chain, the confidences and the cut
from `spark_chain.SparkChain`, and only this one builds on DFlash's network.

Reduced draft vocabularies (`d2t`: the LM head and W2 speak V_d draft ids, W1 is indexed by
target ids) draft in V_d and map each token through `draft_to_target`; q is scattered into
the target's vocabulary with zeros elsewhere, so rejection sampling stays exact.
speculators' checkpoints may keep row 0 for the anchor only (`sample_from_anchor: false`):
rows 1..B-1 then draft, B-1 tokens, d_0's Markov predecessor still y.

Trees (`tree_budget=N`): heads without a Markov head (DeepSpec's "DFlash" layout) draft
DDTree-style trees from U (`block_tree`), cut to the confidence length (read in the tree's
one host sync); with a Markov head each row depends on the token before it, and the tree
is the N most likely paths of the Markov chain itself, grown depth by depth on the device
(`SparkChain._markov_tree`), each node kept while its path's confidence product clears the
threshold.

Non-goals: the `gated`/`rnn` Markov variants.
"""

from __future__ import annotations

from typing import Sequence

import mlx.core as mx
import mlx.nn as nn

from ..taps import decoder_stack, embedding
from .base import MAX_DRAFT, SavesState, check_draft_to_target, check_target, target_lm_head
from .block_tree import tree_verifiable
from .dflash import BlockConfig, BlockContext, DFlashNet, assign, read_weights
from .dflash.drafter import block_inputs, check_block_target
from .dspark_v4 import probe as probe_v4
from .spark_chain import ConfidenceHead, MarkovHead, SparkChain, SparkConfig

EXTRA_PREFIXES = ("embed_tokens.", "lm_head.", "markov_head.", "confidence_head.")


class SparkHeads(nn.Module):
    """What DSpark adds to the DFlash network (key names as in DeepSpec checkpoints)."""

    def __init__(self, cfg: BlockConfig, spark: SparkConfig):
        super().__init__()
        H, V, r = cfg.hidden_size, spark.vocab_size, spark.markov_rank
        if spark.own_embeddings:
            self.embed_tokens = nn.Embedding(V, H)
        if spark.own_lm_head:
            self.lm_head = nn.Linear(H, spark.draft_vocab, bias=False)
        if r:
            self.markov_head = MarkovHead(V, r, spark.draft_vocab)
        if spark.confidence_head:
            dims = H + (r if spark.confidence_with_markov else 0)
            self.confidence_head = ConfidenceHead(dims, spark.confidence_bias)


class DSparkDrafter(SparkChain, SavesState):
    """DSpark drafter: proposes up to B tokens per step (B = block_size, capped at MAX_DRAFT)."""

    STATE = ("context.caches",)  # committed state (SavesState)

    def __init__(self, net: DFlashNet, cfg: BlockConfig, spark: SparkConfig, heads: SparkHeads,
                 taps: Sequence, *, confidence_threshold: float | None = None,
                 cut: str = "sync", sample_drafts: bool = True,
                 draft_to_target: mx.array | None = None, tree_budget: int | None = None):
        self.cfg, self.spark, self.heads, self.taps = cfg, spark, heads, tuple(taps)
        self.draft_to_target = draft_to_target
        # speculators' slot convention: row 0 holds the anchor only, rows 1.. draft
        self._skip = 0 if spark.sample_from_anchor else 1
        self.max_draft = min(cfg.block_size - self._skip, MAX_DRAFT)
        self.sample_drafts = sample_drafts
        self.set_cut(confidence_threshold, cut)
        self.set_tree(tree_budget)  # DDTree-style trees: heads without a Markov head only
        self.context = BlockContext(net, cfg, self.taps)  # DFlash's block forward, reused
        self._embed = self._head = None

    def bind(self, model, tokenizer) -> None:
        check_block_target(model, self.cfg, self.taps, "this DSpark head", vocab=self.spark.vocab_size)
        if self.draft_to_target is not None:
            check_target(model, "this DSpark head", token_ids={
                "largest draft_to_target id": int(self.draft_to_target.max())})
        h = self.heads
        self._embed = h.embed_tokens if "embed_tokens" in h else embedding(decoder_stack(model))
        self._head = h.lm_head if "lm_head" in h else target_lm_head(model)
        self.trees = self.tree_budget is not None and tree_verifiable(model)
        self.context.reset()

    def prefill(self, tokens: Sequence[int], taps: dict | None) -> None:
        self.context.add(taps, len(tokens))

    def commit(self, tokens: Sequence[int], taps: dict | None) -> None:
        self.context.add(taps, len(tokens))

    def step_logits(self, y: int, k: int) -> tuple[mx.array, mx.array]:
        """Parallel stage: (base logits U [k, V], hidden rows h [k, H]) for anchor y."""
        if self._embed is None:
            raise RuntimeError("bind(model, tokenizer) the drafter before using it")
        x = self._embed(block_inputs(y, self.cfg))
        if self.cfg.input_embedding_scale != 1.0:
            x = x * self.cfg.input_embedding_scale
        h = self.context.forward(x)[self._skip : self._skip + k]  # the whole block runs
        return self._head(h), h


def load(folder, config: dict, model, *, confidence_threshold: float | None = None,
         cut: str = "sync", sample_drafts: bool = True,
         tree_budget: int | None = None) -> DSparkDrafter:
    """The DSpark drafter stored in a converted head folder (LOADERS["dspark"])."""
    cfg, spark = BlockConfig.from_dict(config), SparkConfig.from_dict(config)
    weights = read_weights(folder)
    d2t = weights.pop("draft_to_target", None)
    mine = {k: v for k, v in weights.items() if k.startswith(EXTRA_PREFIXES)}
    net, heads = DFlashNet(cfg), SparkHeads(cfg, spark)
    assign(net, {k: v for k, v in weights.items() if k not in mine}, config, f"DSpark head {folder}")
    assign(heads, mine, config, f"DSpark head {folder}")
    if (d2t is None) != (spark.draft_vocab == spark.vocab_size):
        raise ValueError(f"DSpark head {folder}: a draft vocabulary of {spark.draft_vocab} tokens "
                         f"for a {spark.vocab_size}-token target needs draft_to_target, and only it")
    if d2t is not None:
        check_draft_to_target(d2t, f"DSpark head {folder}")
    return DSparkDrafter(net, cfg, spark, heads, config["mlx_spec"]["taps"],
                         confidence_threshold=confidence_threshold, cut=cut,
                         sample_drafts=sample_drafts, draft_to_target=d2t, tree_budget=tree_budget)


def probe_target(folder, config: dict, model, **options):
    """TARGET_PROBES["dspark"]: DSpark stages inside a DeepSeek-V4 checkpoint (`mtp.*`).

    None when the folder's config has no `dspark_*` fields. Otherwise the
    drafter over the checkpoint's own stages (`mlx_spec.drafters.dspark_v4`,
    docs/dflash.md), for a target loaded by mlx-lm's `deepseek_v41` model;
    clear errors for missing fields or tensors. `options` as for `load`.
    """
    text = config.get("text_config", config)
    if not any(key.startswith("dspark_") for key in text):
        return None
    if options.pop("tree_budget", None) is not None:
        raise ValueError("tree_budget: the DSpark stages of a DeepSeek-V4 checkpoint draft chains "
                         "(a DeepSeek-V4 target's sliding-window and compressed caches cannot verify "
                         "a tree in one forward)")
    return probe_v4(folder, config, model, **options)
