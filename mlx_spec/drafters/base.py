"""The one protocol every drafter speaks, and what a proposal looks like.

The decode loop never branches on drafter kind. Per step it calls
`propose(y, k, sampling)` and, once the target has verified the block,
`commit(tokens, taps)` with exactly the tokens the target consumed and kept
(`[y, d0 .. d(n-1)]`). A drafter never hears about rejected tokens: it trims its
own state back to what was committed.

`taps` is how heads (MTP, EAGLE, DFlash, DSpark) receive the target's hidden
states: a drafter lists the tap ids it needs in `.taps` (see `mlx_spec.taps`:
k = the output of decoder layer k, `EMBED`, `FINAL_NORM`) and gets
`{id: [T, H]}` for exactly the committed positions. N-gram and draft-model
drafters ask for nothing and get None.
"""

from __future__ import annotations

import copy
import weakref
from dataclasses import dataclass
from typing import Callable, Mapping, Protocol, Sequence

import mlx.core as mx
import numpy as np

from ..cache import MAX_DRAFT  # noqa: F401 (re-exported: the drafters cap max_draft at it)
from ..sampling import Sampling
from ..taps import EMBED, FINAL_NORM, decoder_stack, embedding, layer_count

PREFILL_CHUNK = 512  # prompt positions a drafter consumes per forward in prefill (bounds its peak memory)


@dataclass(frozen=True)
class Draft:
    """Proposed tokens `d[0..k)` and, when the drafter has them, their `q`."""

    tokens: mx.array  # [k] token ids; may still be lazy
    q: mx.array | None = None  # [k, V] draft probabilities; None = point mass
    length: mx.array | None = None  # lazy count of leading tokens to verify (None: all k)
    # A tree instead of a chain: node j's parent (-1: y), breadth-first (`mlx_spec.tree`);
    # q[j] is what node j was drawn from given its path and earlier siblings (None: point masses).
    parents: tuple[int, ...] | None = None

    def __post_init__(self):  # (shapes only: nothing lazy is evaluated)
        if self.tokens.ndim != 1:
            raise ValueError(f"a Draft's tokens must be one row of token ids, got shape {self.tokens.shape}")
        k = self.tokens.shape[0]
        if self.parents is not None and len(self.parents) != k:
            raise ValueError(f"a tree Draft needs one parent per token: {k} tokens, {len(self.parents)} parents")
        if self.q is not None and self.q.shape[0] != k:
            raise ValueError(f"a Draft's q needs one row of probabilities per token: {k} tokens, "
                             f"q of shape {self.q.shape}")

    @property
    def size(self) -> int:
        return self.tokens.shape[0]


# Made from data, not `mx.zeros`: a lazy array belongs to the stream of the thread that made
# it, and this one is used by whichever thread decodes (a server's engine thread).
EMPTY = Draft(mx.array([], mx.uint32))


class Drafter(Protocol):
    """What the decode loop calls, in this order, once per generation:

        bind(model, tokenizer)        # then the loop reads .taps and .max_draft
        prefill(prompt, taps)
        repeat: propose(y, k, sampling) (skipped when k == 0), verify, commit(kept, taps)

    Contracts the loop relies on (breaking the first one breaks losslessness):

    * **A cut never looks at the token it gates.** With `Draft.length = L`, the event
      "d_j is verified" (j < L) may depend on y, d_0 .. d_(j-1) and the drafter's state,
      never on d_j itself or on later tokens. Then, given that it is verified, d_j is
      still distributed as q_j and rejection sampling stays exact. A cut that reads d_j
      (say, its own probability q_j(d_j)) keeps unlikely draws out of verification and
      skews the output. DSpark's c_j reads h_j and d_(j-1) only (`spark_chain`).
    * **q is what the tokens were drawn from.** `q[j]` is the distribution d_j was drawn
      from, given d_<j and the state, over the target's vocabulary (zero outside the
      drafter's own); q = None means the tokens are checked as point masses, which is
      lossless whatever they are.
    * **`taps` is read after `bind`.** A drafter may choose its taps in `bind` (MTP
      picks the final norm or the last layer of this target), so the loop installs
      the recorders only afterwards; `max_draft` too is read after `bind`.
    * **`bind` is cheap and resets everything.** It runs at the start of every
      generation, also on a drafter that served one before: it checks the target
      (`check_target`, raising ValueError) and drops all per-generation state (caches,
      queued features, counters), so no earlier generation leaks into this one. Work
      that depends only on the target (an n-gram corpus index, a vocabulary
      comparison) is done once and kept.
    * **`propose` stays lazy.** It returns lazy arrays and does no host sync, so the
      draft joins the verify forward in the step's single evaluation. A drafter that
      must read a device value on the host documents it (DSpark's `cut="sync"`).
      It may return fewer than k tokens; k is 1 .. min(max_draft, MAX_DRAFT).
    * **`commit` gets exactly what the target kept.** `tokens` = `[y, d_0 .. d_(n-1)]`,
      the inputs of this step the target consumed and kept (n accepted drafts, n <= L);
      the target's own next token is not among them, it is the next `propose`'s y.
      `taps` holds the target's hidden states at exactly those n + 1 positions (None
      when `.taps` is empty). It also follows steps where nothing was proposed
      (n = 0, `[y]` only), and rejected drafts are never reported: the drafter trims
      whatever its proposal left behind. The loop may commit a prefix of what was
      kept (the tokens the caller saw before stopping), then further tokens with no
      proposal in between.
    * **`prefill` appends.** It adds the prompt to whatever the drafter holds: nothing
      after `bind`, or a state put back by `restore_state`.
    * **Optional `together()` / `propose_together(...)`**: drafters that return the same
      key from `together()` (None: this one cannot) may be asked, in a batch, to propose
      for all their rows at once with `type(d).propose_together(drafters, ys, ks,
      samplings, keys)`, which must leave each drafter exactly as its own `propose` would
      have (the draft model: one batched forward per depth instead of one per row).
    * **Optional `backlog`**: committed tokens (the prompt too) a drafter has queued and
      will read before its next proposal (the draft model reads the prompt at its first
      proposal, in evaluated chunks: that proposal syncs with the host once per chunk).
      The loop weighs reading it against what drafting can still save, and decodes the
      request plainly when it does not pay (`Row.drafting_pays`).
    * **Optional `save_state()` / `restore_state(state)`** (`SavesState`): an independent
      copy of everything committed, taken between steps, and its restoration. With
      them a drafter continues a conversation held in a reused prompt cache, reading
      only the new prompt; without them it re-reads the history it can (n-gram, draft
      model) or only the new prompt (heads, which need the target's hidden states).
    """

    taps: tuple  # tap ids this drafter reads (mlx_spec.taps); () for none
    max_draft: int  # the most tokens one propose() can return (<= MAX_DRAFT)

    def bind(self, model, tokenizer) -> None:
        """Check compatibility with the target (raise ValueError) and reset all state."""

    def prefill(self, tokens: Sequence[int], taps: dict | None) -> None:
        """The target consumed the prompt `tokens` (with a reused prompt cache: the new part)."""

    def propose(self, y: int, k: int, sampling: Sampling) -> Draft:
        """Up to k tokens to follow the committed context and `y` (not yet consumed); lazy."""

    def commit(self, tokens: Sequence[int], taps: dict | None) -> None:
        """The target consumed and kept `tokens` (`[y, accepted drafts...]`)."""


class SavesState:
    """`save_state` / `restore_state` for a drafter whose committed state lives in the
    attributes named by `STATE` (dotted paths; none of them may hold a model)."""

    STATE: tuple[str, ...] = ()

    def save_state(self) -> dict:
        return {path: copy.deepcopy(_get(self, path)) for path in self.STATE}

    def fork(self):
        """A drafter sharing this one's weights, with state of its own (for another request).

        The objects on the `STATE` paths are copied, so `bind` on the fork resets only its own.
        """
        new = copy.copy(self)
        new.forked_from = weakref.ref(self)  # where an adaptive policy may start from
        for path in self.STATE:
            owner = new
            for name in path.split(".")[:-1]:
                setattr(owner, name, copy.copy(getattr(owner, name)))
                owner = getattr(owner, name)
        return new

    def restore_state(self, state: dict) -> None:
        for path, value in state.items():  # copied again: a state can be restored many times
            owner, _, name = path.rpartition(".")
            setattr(_get(self, owner) if owner else self, name, copy.deepcopy(value))


class PlansTrees:
    """What a drafter that grows dynamic trees (`tree_budget`, `tree_width`) offers `auto`: the
    next proposal's shape is chosen before it is drafted (`plan_tree`: the whole tree, one with
    half or a quarter of the nodes and narrower depths, or a chain), so a step that verifies a
    chain or a small tree pays only its own draft forwards (`mlx_spec.tree_shape.ShapeChoice`)."""

    tree_budget: int | None = None
    tree_width: int = 4
    _plan = 1  # the next proposal's shape (ShapeChoice.SHAPES); one proposal only

    def plans_trees(self) -> bool:
        """Whether proposals are dynamic trees, so `plan_tree` shapes them."""
        return self.tree_budget is not None

    def plan_tree(self, shape: int) -> None:
        self._plan = shape

    def step_tree(self) -> tuple[int, int] | None:
        """This proposal's (node budget, width), None: draft a chain; the plan is used up. A
        shape s > 1 keeps 1/s of the nodes and feeds 1/s of the rows at each depth (at least 2:
        a narrower tree is a chain), which is what makes it cheaper to draft."""
        shape, self._plan = self._plan, 1
        if self.tree_budget is None or shape == 0:
            return None
        return -(-self.tree_budget // shape), min(self.tree_width, max(2, -(-self.tree_width // shape)))


def _get(obj, path: str):
    for name in path.split("."):
        obj = getattr(obj, name)
    return obj


def pick(logits: mx.array, sampling: Sampling, key: mx.array | None = None) -> tuple[mx.array, mx.array | None]:
    """One draft token from logits [V]: argmax when greedy, else a draw from q (returned),
    with `key` (None: MLX's global random stream)."""
    if sampling.greedy:
        return mx.argmax(logits), None
    q = sampling.probs(logits)
    return mx.random.categorical(mx.log(q), key=key), q


def pick_block(logits: mx.array, sampling: Sampling, sample_drafts: bool) -> Draft:
    """Tokens from independent per-position logits [k, V]: argmax, or drawn from q when
    `sample_drafts` (block drafters: DFlash, DSpark without a Markov head)."""
    if sampling.greedy or not sample_drafts:
        return Draft(mx.argmax(logits, axis=-1).astype(mx.uint32), None)
    q = sampling.probs(logits)  # [k, V]
    return Draft(mx.random.categorical(mx.log(q)).astype(mx.uint32), q)


def chain(
    logits: mx.array,
    k: int,
    sampling: Sampling,
    step: Callable[[mx.array], mx.array],
    choose: Callable = pick,
    min_confidence: float | None = None,
) -> Draft:
    """k chained draft steps, all lazy: take a token from `logits`, then `logits = step(token)`.

    `choose(logits, sampling) -> (token id, q over the target vocabulary | None)`.
    `min_confidence`: the chain ends early after a token the drafter itself gave less than
    this probability (`confidence`), one host read a token; that token is still proposed, so
    whether a token is verified never depends on the token itself (`Drafter`'s first contract).
    """
    tokens, qs = [], []
    for i in range(k):
        t, q = choose(logits, sampling)
        tokens.append(t)
        if q is not None:
            qs.append(q)
        if i < k - 1:
            if min_confidence is not None and confidence(logits, t, q).item() < min_confidence:
                break
            logits = step(t.reshape(1).astype(mx.uint32))
    return Draft(mx.stack(tokens).astype(mx.uint32), mx.stack(qs) if qs else None)


def confidence(logits: mx.array, tokens: mx.array, q: mx.array | None) -> mx.array:
    """The drafter's probability of each token it chose from `logits` [..., V] (lazy): q(token)
    where it was drawn from q [..., V], else (greedy: the argmax) the softmax's largest value."""
    if q is not None:
        return mx.take_along_axis(q, tokens[..., None].astype(mx.int32), axis=-1)[..., 0]
    return mx.exp(mx.max(logits, axis=-1) - mx.logsumexp(logits, axis=-1))


def _output_module(model):
    """The module holding the target's output rows: its own `lm_head`, or the tied embedding."""
    for owner in (model, getattr(model, "language_model", None)):
        if owner is not None and "lm_head" in owner:
            return owner["lm_head"], False
    return embedding(decoder_stack(model)), True


def target_lm_head(model):
    """The target's output projection: its own `lm_head`, or the tied embedding."""
    m, tied = _output_module(model)
    return m.as_linear if tied else m


def target_output_rows(model, ids) -> mx.array:
    """Rows `ids` of the target's output projection as dense float32 [len(ids), H]
    (dequantized when the target is quantized): row i scores token ids[i]."""
    m, _ = _output_module(model)
    ids = mx.array(ids, dtype=mx.int32)
    w = m["weight"][ids]
    if "scales" in m:
        biases = m["biases"][ids] if "biases" in m else None
        w = mx.dequantize(w, m["scales"][ids], biases, group_size=m.group_size, bits=m.bits,
                          mode=getattr(m, "mode", "affine"))
    return w.astype(mx.float32)


def vocab_size(model) -> int:
    """Size of the model's output vocabulary (its logits' last dimension)."""
    args = getattr(model, "args", None)
    size = getattr(args, "vocab_size", None)
    if size is None:
        size = model.model.embed_tokens.weight.shape[0]
    return int(size)


def target_args(model) -> dict:
    """The target's config fields (the text config of a multimodal wrapper)."""
    args = getattr(model, "args", None)
    text = getattr(args, "text_config", None)
    if isinstance(text, dict):
        return dict(text)
    return dict(vars(args)) if args is not None else {}


# The two remedies a target mismatch can have.
RECONVERT = ("Use a head made for this model: a head trained for another model cannot draft for it "
             "(if this is the model it was trained for, convert it again with --target pointing here).")
SAME_WEIGHTS = "Use the weights of this very model: load the target from the folder that holds them."


def check_draft_to_target(d2t: mx.array, where: str) -> None:
    """A reduced draft vocabulary's table: one distinct target id >= 0 per draft token (the upper
    bound is the target's, checked when the drafter is bound)."""
    ids = np.array(d2t).reshape(-1)
    if ids.size and (ids.min() < 0 or np.unique(ids).size < ids.size):
        raise ValueError(f"{where}: draft_to_target must map each draft token to its own target token "
                         f"(distinct ids >= 0), but it has {ids.size - np.unique(ids).size} repeated and "
                         f"{int((ids < 0).sum())} negative; convert the head again from its checkpoint's d2t")


def check_target(
    model,
    what: str,
    fix: str = RECONVERT,
    *,
    made_for: Mapping | None = None,
    hidden_size: int | None = None,
    vocab: int | None = None,
    layers: Sequence = (),
    token_ids: Mapping[str, int] | None = None,
) -> None:
    """Refuse a target the drafter does not fit: one ValueError naming every mismatch, and `fix`.

    `what` names the drafter ("this DFlash head"). Each check runs only when given:
    `made_for` the target config fields the head was converted for (a converted folder's
    `mlx_spec.target`), compared where the target has the field (`model_type` never is:
    checkpoints and mlx-lm may name one architecture differently); `hidden_size` the width
    the drafter reads, against the target's embedding width; `vocab` the vocabulary it
    drafts over, against the target's; `layers` the tap ids it reads (decoder layers
    0..n-1, `EMBED`, `FINAL_NORM`); `token_ids` ({name: id}) tokens it feeds or emits,
    each inside the target's vocabulary.
    """
    problems = []
    if made_for:
        have = target_args(model)
        differ = [f"{key}: head made for {want}, target has {have[key]}"
                  for key, want in made_for.items()
                  if key != "model_type" and want is not None and have.get(key) is not None
                  and have[key] != want]
        if differ:
            problems.append(f"converted for another target ({'; '.join(differ)})")
    if layers:
        n = layer_count(model)
        bad = list(dict.fromkeys(t for t in layers if t not in (EMBED, FINAL_NORM)
                                 and not (isinstance(t, int) and 0 <= t < n)))
        if bad:
            problems.append(f"reads target layers {bad}, but the target has {n} decoder layers (0..{n - 1})")
    if hidden_size is not None:
        width = embedding(decoder_stack(model))(mx.array([0])).shape[-1]  # shape only: nothing is computed
        if width != hidden_size:
            problems.append(f"{hidden_size} wide, but the target's embeddings are {width} wide")
    if vocab is not None or token_ids:
        V = vocab_size(model)
        if vocab is not None and vocab != V:
            problems.append(f"drafts over {vocab} tokens, but the target's vocabulary has {V}")
        problems += [f"{name} {tid} is outside the target's vocabulary (0..{V - 1})"
                     for name, tid in (token_ids or {}).items() if not 0 <= tid < V]
    if problems:
        raise ValueError(f"{what} cannot draft for this target: {'; '.join(problems)}. {fix}")
