"""A small language model with the target's tokenizer as the drafter.

It keeps its own (rollback-capable) cache. `propose` feeds the committed tokens
it has not seen yet (the prompt too: it is read at the first proposal, so a request
that never drafts never pays for it) plus y, then chains k steps, each sampling on device from
its own filtered distribution `q` (argmax when greedy): k lazy steps, no host
sync, so the draft joins the step's single graph. After verification it trims
its cache to the committed prefix; a fully accepted block leaves d[k-1]
unconsumed, so that token is queued for the next proposal.

Lookup-guided chains (`lookup=True`, the default; plain KV draft caches): when
the committed text has an earlier occurrence of its last few tokens (prompt lookup,
`NGramIndex`), what followed it is fed as a guess in the proposal's first forward; the
draft model's choice at each guessed position (its argmax; when sampling, the guessed token
kept with its probability under q) says how far the guess is its own chain, and it goes on
token by token from the first disagreement. The draft is the same chain (the same argmax
tokens; sampled tokens with the same law q), drafted in one forward instead of one per
token where the text repeats itself. The guess's rows past the agreement are trimmed off.

The draft's LM head (`head_vocab=n`, default 49152, when the draft's vocabulary is larger):
only the rows of the first n token ids and of the tokens already in the text are computed
(`mlx_spec.drafters.short_head`); the drafts come from that subset, laid out over the
target's vocabulary with -inf elsewhere, so the target's verification is unchanged.

Confident chains (`min_confidence=p`, default 0.5): a chain ends after a token the draft model
gave less than probability p (its argmax's softmax value; sampled: q of the token drawn), as
Hugging Face's assisted generation does with `assistant_confidence_threshold`; that token
is still proposed, so the target's acceptance law is untouched. `auto` asks for a length
and the chain stops short where the draft is unsure: the forwards past it, likely rejected,
are not paid for. One host read a draft token. Trees (`branches`, `tree_budget`) are drafted
whole: the threshold applies to chains (guided or not) only.

Trees: `branches=b` adds each depth's b - 1 runner-up tokens as leaves of the chain;
`tree_budget=N` grows an EAGLE-2 dynamic tree of N nodes and at most k levels
(`mlx_spec.dynamic_tree`): each depth's frontier is fed in one forward with a tree mask
over the draft's own cache, and after verification the accepted path's rows are gathered
into place and the rest dropped. Either way the drafter records which token paths it fed
to which rows of its cache; a chain is the tree whose fed rows are its first k - 1 tokens.
"""

from __future__ import annotations

import logging
import time
from typing import Sequence

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from .. import dynamic_tree, tree
from ..cache import Checkpoint, make_cache
from ..calibration import spent_once
from ..identity import IdentityMap
from ..overlap import overlapped
from ..request import whole
from ..sampling import Sampling
from .base import MAX_DRAFT, PREFILL_CHUNK, Draft, PlansTrees, SavesState, chain, confidence, vocab_size
from .ngram import NGramIndex
from .short_head import HEAD_VOCAB, short_head

log = logging.getLogger("mlx_spec")
CATCH_UP = 16  # queued tokens fed with a proposal's own forward; more are read first, alone
LOOKUP_N = (2, 4)  # the n-grams whose continuations guide the chains (as NGramDrafter's defaults)
MIN_CONFIDENCE = 0.5  # a chain ends after a token drafted with a lower probability


_CALIBRATIONS = IdentityMap()  # draft model -> target -> dynamic_tree.Calibration


class DraftModelDrafter(SavesState, PlansTrees):
    """Draft with `draft_model`; pass its tokenizer to have the vocabularies compared."""

    STATE = ("cache", "_pending", "_index")  # committed state (SavesState)

    taps: tuple[int, ...] = ()
    max_draft = MAX_DRAFT

    def __init__(self, draft_model, draft_tokenizer=None, branches: int = 1,
                 tree_budget: int | None = None, tree_width: int = 4, lookup: bool = True,
                 head_vocab: int | None = HEAD_VOCAB, min_confidence: float | None = MIN_CONFIDENCE):
        if head_vocab is not None and not (type(head_vocab) is int and head_vocab >= 1):
            raise ValueError(f"head_vocab must be a positive integer (the draft's LM head over that many "
                             f"token ids and the text's own) or None (its whole vocabulary), got {head_vocab!r}")
        if min_confidence is not None and not (isinstance(min_confidence, (int, float))
                                               and not isinstance(min_confidence, bool) and 0 < min_confidence <= 1):
            raise ValueError(f"min_confidence must be a probability in (0, 1] (a chain ends after a token "
                             f"drafted with less) or None (chains as long as asked), got {min_confidence!r}")
        if not (whole(branches) and 1 <= branches <= 4):
            raise ValueError(f"branches must be an integer in 1..4, got {branches!r}")
        dynamic_tree.check_settings(tree_budget, tree_width)
        if tree_budget is not None and branches != 1:
            raise ValueError("branches (fixed runner-up leaves) and tree_budget (an EAGLE-2 dynamic "
                             "tree) are two tree shapes: give one of them")
        self.branches, self.tree_budget, self.tree_width = branches, tree_budget, tree_width
        self.lookup = bool(lookup)  # guesses from prompt lookup, checked in one forward
        self.head_vocab = head_vocab  # the LM head's rows drafted from (`short_head`; None: all)
        self.min_confidence = min_confidence  # chains end after a less likely token (None: never)
        self._head = None  # its `ShortHead` (`bind`; None: the model's own head)
        self._vocab: tuple = (None, 0, ())  # (the index scanned, tokens scanned, the extras found)
        self._index = NGramIndex(*LOOKUP_N)  # the committed text (prompt included), for the guesses
        self.guessed = [0, 0]  # guessed tokens fed, of them kept (what lookup paid; forks add to it too)
        self._grows = False  # tree_budget on a draft cache that can take tree blocks (`bind`)
        self.model = draft_model
        self.tokenizer = draft_tokenizer
        self.cache: list = []
        self._pending: list[int] = []  # committed tokens the draft has not consumed
        self._k = 0  # size of the outstanding proposal (0: none)
        self._ckpt: Checkpoint | None = None
        self._checked = None  # the target tokenizer the vocabularies were last compared with
        self.calibration: dynamic_tree.Calibration | None = None  # (`bind`: per draft model and target)
        self._rates = self._learner = None  # sampled trees: what this request's taught (`bind`)
        self._nodes: dict = {}  # this proposal's tree nodes: path -> (probability, best child?)
        self._taught = None  # the last tree's (learner, nodes, kept tokens), until the next y is known

    def bind(self, model, tokenizer) -> None:
        v_t, v_d = vocab_size(model), vocab_size(self.model)
        if self.tokenizer is not None and self._checked is not tokenizer:
            _check_same_vocab(tokenizer, self.tokenizer)  # ~150k entries: once per tokenizer
            self._checked = tokenizer
        elif v_t != v_d:
            raise ValueError(
                f"vocabulary mismatch: the target has {v_t} token ids, the draft model "
                f"{v_d}. The draft must use the target's tokenizer (a DraftModelDrafter(draft, "
                "draft_tokenizer) compares the two tokenizers token by token)."
            )
        self._v_target, self._v_draft = v_t, v_d
        self._rates = dynamic_tree.DrawnRates()  # every request starts from the priors
        self.cache = make_cache(self.model)
        self._head = short_head(self.model, self.head_vocab, min(v_t, v_d))
        self._pending, self._k, self._nodes, self._taught = [], 0, {}, None
        self._index = NGramIndex(*LOOKUP_N)
        self._grows = self.tree_budget is not None and tree.tree_capable(self.cache, self.model)
        # what this draft's probabilities are worth to this target, learned from the tree nodes
        # verified by every drafter of the process with the same two models, and kept for the
        # next process (`keep_learned`)
        self.calibration = None
        if self._grows:
            from ..learned import load_tree_calibration

            self.calibration = _CALIBRATIONS.setdefault(self.model, IdentityMap).setdefault(
                model, lambda: load_tree_calibration(model, self.model))
        if self.tree_budget is not None and not self._grows:
            log.warning("tree_budget: this draft model cannot grow trees (its cache has sliding-window or "
                        "recurrent layers, or its ropes do not alone place positions), so it drafts chains")

    def keep_learned(self, target) -> None:
        """After a request on `target`: what the dynamic trees' nodes taught the calibration
        outlives the process."""
        from ..learned import save_tree_calibration

        if self._grows:
            save_tree_calibration(self.calibration, target, self.model)

    def _logits(self, tokens: mx.array) -> mx.array:
        """Draft logits at the last position, laid out over the target vocabulary."""
        with overlapped(self.model):  # evaluated in pieces while the next steps are built
            return self._run(tokens[None], self.cache, last=1)[0, -1]

    def _tree_logits(self, tokens: mx.array, slots, mask: mx.array, shift: int) -> mx.array:
        """One depth of a dynamic tree fed at once ([w] tokens -> [w, V]; `dynamic_tree.Step`)."""
        with overlapped(self.model):
            return tree.call_block(self.model, self.cache, mask, [shift] * tokens.shape[0],
                                   lambda wrapped: self._run(tokens[None], wrapped)[0])

    def _run(self, x: mx.array, cache, last: int | None = None) -> mx.array:
        """Draft logits [B, T, V] of the last `last` positions of `x` [B, T] (None: all), laid
        out over the target vocabulary; from the subset head when there is one."""
        if self._head is None:
            out = self.model(x, cache=cache)
            return self._layout(out if last is None else out[:, -last:])
        extra = self._extras()
        return self._head.layout(self._head(x, cache, extra, last), extra, width=self._v_target)

    def _extras(self) -> tuple:
        """The text's tokens the subset head's base ids lack (`ShortHead.extras`), kept up to
        date with the committed text as it grows."""
        index, seen, extra = self._vocab
        tokens = self._index.tokens
        if index is not self._index or seen > len(tokens):  # another text: scanned afresh
            seen, extra = 0, ()
        if seen < len(tokens):
            extra = self._head.extras(tokens[seen:], extra)
        self._vocab = (self._index, len(tokens), extra)
        return extra

    def _layout(self, logits: mx.array) -> mx.array:
        """Logits over the draft's vocabulary [..., V_d] laid out over the target's."""
        if self._v_draft > self._v_target:  # padding rows no tokenizer id reaches
            logits = logits[..., : self._v_target]
        elif self._v_draft < self._v_target:
            pad = mx.full((*logits.shape[:-1], self._v_target - self._v_draft), -mx.inf, logits.dtype)
            logits = mx.concatenate([logits, pad], axis=-1)
        return logits

    def prefill(self, tokens: Sequence[int], taps) -> None:
        """Queue the prompt: the draft reads it when it first drafts (`backlog`), so a request
        whose policy never drafts (a short answer to a long prompt) never pays for it."""
        self._pending += list(tokens)  # after restore_state, queued tokens come first
        self._index.extend(tokens)

    @property
    def backlog(self) -> int:
        """Committed tokens the draft model has not read yet (fed before its next proposal)."""
        return len(self._pending)

    def _catch_up(self) -> None:
        """A backlog of more than `CATCH_UP` tokens (the prompt) is read now, in chunks of
        which only the cache is evaluated (their logits are never computed: a 150k-token LM
        head over a whole prompt would cost more than the rest); a shorter one goes in with
        the next proposal's own forward. The read is one-time work, not part of what the
        step's shape costs (`calibration.spent_once`)."""
        if len(self._pending) <= CATCH_UP:
            return
        start = time.perf_counter()
        for i in range(0, len(self._pending), PREFILL_CHUNK):
            self.model(mx.array(self._pending[i : i + PREFILL_CHUNK])[None], cache=self.cache)
            mx.eval([c.state for c in self.cache])
        self._pending = []
        spent_once(time.perf_counter() - start)

    def _learn(self, nxt: int) -> None:
        """The last tree's nodes, learned from once the target's token after its kept path, `nxt`
        (the next step's y), is known: the nodes there were examined too, and none was kept."""
        if self._taught is not None:
            learner, nodes, kept = self._taught
            self._taught = None
            learner.learn(nodes, kept + [nxt])

    def propose(self, y: int, k: int, sampling: Sampling) -> Draft:
        self._learn(y)
        self._catch_up()
        self._ckpt, self._fed = Checkpoint(self.model, self.cache), self._pending + [y]
        guess = self._guess(y, k)
        if guess:
            self._pending, self._rows, self._nodes = [], None, {}
            draft = self._guided(guess, k, sampling)
            self._k, self._main = draft.size, draft.tokens
            return draft
        logits = self._logits(mx.array(self._fed, mx.uint32))
        self._pending, self._rows, self._nodes = [], None, {}
        b = self.branches
        shape = self.step_tree() if self._grows else None  # (None: a chain this step)
        if shape is not None:  # EAGLE-2: deeper where the draft is sure, wider where it is not
            self._base = self.cache[0].offset  # plain KV layers (`bind`): where the tree rows start
            budget, width = shape
            # greedy: what earlier requests taught; sampled: what this request's drawn trees did
            # (a seeded sampled request's tree must not depend on earlier ones)
            cal = self.calibration if sampling.greedy else None
            self._learner = cal if sampling.greedy else self._rates
            draft, self._rows = dynamic_tree.grow(logits, self._tree_logits, depth=min(k, budget), width=width,
                                                  budget=budget, sampling=sampling, calibration=cal,
                                                  rates=self._rates, nodes=self._nodes if self._learner else None)
            self._k = max(draft.size, 1)
            return draft
        if b == 1 or k < 2:
            draft = chain(logits, k, sampling, self._logits, min_confidence=self.min_confidence)
            self._k, self._main = draft.size, draft.tokens
            return draft
        # A tree: the draft's chain of its top tokens, each depth's next b - 1 tokens as leaves.
        depth, tops = max(k // b, 1), []
        for d in range(depth):
            top = mx.argpartition(-logits, kth=b - 1)[:b]
            top = top[mx.argsort(-logits[top])].astype(mx.uint32)
            tops.append(top)
            if d < depth - 1:
                logits = self._logits(top[:1])
        self._k, self._main = depth, mx.stack([t[0] for t in tops])
        parents = tuple(-1 if d == 0 else (d - 1) * b for d in range(depth) for _ in range(b))
        return Draft(mx.concatenate(tops), parents=parents)

    def _guess(self, y: int, k: int) -> list[int]:
        """Prompt lookup's continuation of the committed text + y, up to k - 1 tokens, when
        this proposal is a chain on plain KV layers (else none)."""
        if not (self.lookup and k >= 2 and self.branches == 1 and not self._grows
                and all(type(c) is KVCache for c in self.cache)):
            return []
        found = self._index.lookup(self._index.tokens, y, k - 1)
        return found[0] if found else []

    def _guided(self, guess: list[int], k: int, sampling: Sampling) -> Draft:
        """The draft's chain of k tokens with `guess` fed in its first forward (`follow`), then
        one forward a token from the first disagreement."""
        m = len(guess)
        with overlapped(self.model):
            out = self._run(mx.array(self._fed + guess, mx.uint32)[None], self.cache, last=m + 1)[0]
        head, q = self.follow(out, guess, sampling, lambda: None)
        head, q, unsure = self._until_unsure(out, head, q)
        if len(head) <= m:  # the rows of the guess past the agreement are not the chain's
            for c in self.cache:
                c.trim(m + 1 - len(head))
        tokens, rest = mx.array(head, mx.uint32), k - len(head)
        if rest == 0 or unsure:
            return Draft(tokens, q)
        more = chain(self._logits(tokens[-1:]), rest, sampling, self._logits, min_confidence=self.min_confidence)
        return Draft(mx.concatenate([tokens, more.tokens]), None if q is None else mx.concatenate([q, more.q]))

    def _until_unsure(self, out: mx.array, head: list[int], q: mx.array | None):
        """A guided chain's head up to its first token drafted with a probability below
        `min_confidence` (that token included), where an unguided chain would have stopped,
        and whether it stopped there. One host read."""
        if self.min_confidence is None:
            return head, q, False
        n = len(head)
        sure = confidence(out[:n], mx.array(head, mx.uint32), None if q is None else q[:n]).tolist()
        low = [i for i, c in enumerate(sure) if c < self.min_confidence]
        if not low:
            return head, q, False
        n = low[0] + 1
        return head[:n], None if q is None else q[:n], True

    def follow(self, out: mx.array, guess: list[int], sampling: Sampling, key) -> tuple[list[int], mx.array | None]:
        """The head of a guided chain: the draft's distributions `out` [m + 1, V] after y and
        after each of the m guessed tokens, computed at once, give the guess as far as the
        draft's own choice agrees with it (greedy: its argmax is the guessed token; sampled: a
        guessed token g is kept with probability q(g), else the token there is drawn from q
        without g, renormalised, so every draft token is distributed exactly as q, as in an
        unguided chain), then the draft's own token there. Returns the head's tokens (the kept
        guess and one more) and, sampled, their q rows. `key()`: each draw's random key (None:
        MLX's global stream). One host read."""
        m = len(guess)
        if sampling.greedy:
            q, top = None, mx.argmax(out, axis=-1).tolist()
            agreed = 0
            while agreed < m and top[agreed] == guess[agreed]:
                agreed += 1
            head = top[: agreed + 1]
        else:
            q = sampling.probs(out)  # [m + 1, V]
            kept = guess_kept(mx.random.uniform(shape=(m,), key=key()),
                              q[mx.arange(m), mx.array(guess, mx.uint32)]).tolist()
            agreed = kept.index(False) if False in kept else m
            last = q[agreed]
            if agreed < m:  # the draft's own token there: q without the guessed one
                last = mx.where(mx.arange(last.shape[0]) == guess[agreed], 0.0, last)
            head = guess[:agreed] + [mx.random.categorical(mx.log(last), key=key()).item()]
            q = q[: agreed + 1]
        self.guessed[0] += m
        self.guessed[1] += agreed
        return head, q

    def plans_trees(self) -> bool:
        return self._grows

    def together(self):
        """Rows whose drafters share a draft model and draft chains on plain KV caches propose
        together in a batch (`propose_together`); None: this one proposes alone."""
        if self.branches > 1 or self._grows or not all(type(c) is KVCache for c in self.cache):
            return None
        return ("draft model", id(self.model), id(self._head))

    def batch_head(self, drafters: list):
        """For rows drafting together: `run(x, cache)`, the batch's logits, and `place(i, out)`,
        row i's logits laid out over the target vocabulary (i None: every row's, `out` [B, ...]);
        with a subset head they are computed over every row's extras, each row keeping its own."""
        if self._head is None:
            return (lambda x, cache: self.model(x, cache=cache)), (lambda i, out: self._layout(out))
        own = [d._extras() for d in drafters]
        union = tuple(sorted(set().union(*own)))
        head, width = self._head, self._v_target

        def place(i, out):
            if i is None:
                return mx.stack([place(j, out[j]) for j in range(len(own))])
            return head.layout(out, union, None if own[i] == union else own[i], width)

        return (lambda x, cache: head(x, cache, union)), place

    @staticmethod
    def propose_together(drafters: list, ys: list[int], ks: list[int], samplings: list[Sampling],
                         keys: list) -> list[Draft]:
        """Each drafter's `propose(y, k, sampling)` in one batched forward per depth
        (`mlx_spec.drafters.draft_together`)."""
        from .draft_together import propose_together

        return propose_together(drafters, ys, ks, samplings, keys)

    def commit(self, tokens: Sequence[int], taps) -> None:
        tokens = list(tokens)
        self._index.extend(tokens)
        if not self._k:  # nothing proposed this step: just queue what was kept
            if tokens:
                self._learn(tokens[0])
            self._pending += tokens
            return
        # The draft consumed pending + [y], then a block of rows: some node paths of the draft
        # (a chain or fixed tree: its first k - 1 tokens, in order; a dynamic tree: each
        # depth's frontier). It keeps the rows of the longest committed path it was fed,
        # gathered into place when they are not already the block's first rows, and queues
        # the rest of the committed tokens.
        rows = self._rows
        if self._nodes:  # a dynamic tree: what its nodes' probabilities were worth, learned
            self._taught, self._nodes = (self._learner, self._nodes, tokens), {}  # at the next y
        if rows is None:
            main = self._main.tolist()[: self._k - 1]
            rows = {tuple(main[: i + 1]): i for i in range(len(main))}
        path, keep = [], []
        for t in tokens[1:]:
            row = rows.get(tuple(path + [t]))
            if row is None:
                break
            path.append(t)
            keep.append(row)
        fed = len(self._fed) + len(rows)
        if keep != list(range(len(keep))):
            tree.compact(self.cache, self._base, keep)
            fed = len(self._fed) + len(keep)
        kept = self._fed + path
        self._ckpt.keep(kept, fed)
        self._pending = tokens[1 + len(path):]
        self._k, self._ckpt, self._main, self._rows = 0, None, None, None


def guess_kept(u: mx.array, p: mx.array) -> mx.array:
    """Whether each guessed token is kept, given a uniform draw u and its probability p under
    the draft's q (the rule the sampled-law tests break on purpose)."""
    return u < p


def _check_same_vocab(target_tok, draft_tok) -> None:
    vt, vd = target_tok.get_vocab(), draft_tok.get_vocab()
    if vt == vd:
        return
    diff = sorted(set(vt.items()) ^ set(vd.items()), key=lambda kv: kv[1])[:3]
    raise ValueError(
        f"vocabulary mismatch: target tokenizer has {len(vt)} tokens, draft tokenizer "
        f"{len(vd)}; e.g. {diff}. Speculative decoding needs a draft model with the "
        "target's tokenizer (same family, e.g. Qwen2.5-Coder-0.5B for Qwen2.5-Coder-1.5B)."
    )
