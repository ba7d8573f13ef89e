"""A conversation continued from a prompt cache: the target prefills only the new turn, the
drafter continues from its saved state (or re-reads the history), and the output and the
drafts are exactly those of one call over the whole conversation."""

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache

import mlx_spec
import test_dflash as D
import test_eagle_lossless as E
import tiny
from mlx_spec import DraftModelDrafter, NGramDrafter
from mlx_spec.prompt_cache import PromptCacheStore, history
from runs import mlx_lm_greedy as reference

TURN1 = [5, 6, 7, 8, 9, 5, 6, 7, 21, 3]
TURN2 = [9, 5, 6, 7, 8]


def traced(model, drafter, prompt, n, return_stats=False, **kw):
    out = list(mlx_spec.stream_generate(model, tiny.tokenizer(), prompt, drafter, max_tokens=n,
                                        num_draft_tokens=4, trace=True, **kw))
    stats = out[-1].stats
    return [r.token for r in out], stats if return_stats else [t.proposed for t in stats.trace]


def drafter_case(tmp_path, name):
    """(target, a function making a fresh drafter for it) for each kind of drafter state."""
    if name == "ngram":
        return tiny.llama_model(), lambda: NGramDrafter(min_n=1)
    if name == "draft-model":
        draft = tiny.llama_model()  # the target with a noisy head: mostly right, not always
        draft.lm_head.weight = draft.lm_head.weight + 0.5 * mx.random.normal(draft.lm_head.weight.shape,
                                                                            key=mx.random.key(1))
        return tiny.llama_model(), lambda: DraftModelDrafter(draft)
    if name == "eagle":
        model = E.bigram_target()
        head = E._head(tmp_path, model, "eagle", tiny.VOCAB)
        return model, lambda: mlx_spec.load_drafter(head, model)
    model, _ = D.target("qwen3-echo")
    head, _, _ = D.make_head(tmp_path, "qwen3-echo", copy=True)
    return model, lambda: mlx_spec.load_drafter(head, model)


def held_positions(drafter) -> int:
    """How many committed positions a drafter's state covers (heads: their context)."""
    if isinstance(drafter, NGramDrafter):
        return len(drafter._index.tokens)
    if isinstance(drafter, DraftModelDrafter):
        return drafter.cache[0].offset + len(drafter._pending)
    if hasattr(drafter, "context"):  # DFlash: context rows
        return drafter.context.length
    return drafter.cache[0].offset + drafter._feats.shape[0]  # EAGLE: pairs fed + waiting features


def mid_block_stop(model, make) -> int:
    """A count of tokens that ends inside a verified block, before its kept drafts end."""
    _, out = traced(model, make(), TURN1, 30, return_stats=True)
    done = 1  # the first token comes from the prefill
    for step in out.trace:
        if step.accepted >= 1:
            return done + 1
        done += step.accepted + 1
    raise AssertionError("no block kept a draft")


@pytest.mark.parametrize("name", ["ngram", "draft-model", "eagle", "dflash"])
@pytest.mark.parametrize("stop", ["end", "mid-block"])
def test_the_second_turn_drafts_as_if_the_whole_conversation_were_one_prompt(tmp_path, name, stop):
    model, make = drafter_case(tmp_path, name)
    drafter, cache = make(), mlx_spec.make_cache(model)
    gen = mlx_spec.stream_generate(model, tiny.tokenizer(), TURN1, drafter, max_tokens=30,
                                   num_draft_tokens=4, prompt_cache=cache)
    first = [next(gen).token for _ in range(30 if stop == "end" else mid_block_stop(model, make))]
    gen.close()  # mid-block: the drafter had been told more than the caller saw
    held = history(cache)
    assert held.tokens == tuple(TURN1 + first) and held.state is not None
    history_ = TURN1 + first + TURN2
    got, drafts = traced(model, drafter, TURN2, 25, prompt_cache=cache)
    fresh = make()
    want, want_drafts = traced(model, fresh, history_, 25, prompt_cache=mlx_spec.make_cache(model))
    assert got == want == reference(model, history_, 25)
    assert drafts == want_drafts  # the drafter's state over the history is the same...
    assert held_positions(drafter) == held_positions(fresh) == len(history_) + 25  # ...and as long
    assert sum(len(d) for d in drafts) > 10


def test_a_drafter_without_saved_state_rereads_the_history_it_can(tmp_path):
    model = tiny.llama_model()
    cache = mlx_spec.make_cache(model)
    first = [r.token for r in mlx_spec.stream_generate(model, tiny.tokenizer(), TURN1, None,
                                                        max_tokens=20, prompt_cache=cache)]
    # Turn 1 ran without a drafter; turn 2's n-gram drafter still sees turn 1.
    got, drafts = traced(model, NGramDrafter(min_n=1), TURN2, 20, prompt_cache=cache)
    want, want_drafts = traced(model, NGramDrafter(min_n=1), TURN1 + first + TURN2, 20)
    assert got == want and drafts == want_drafts


def test_a_cache_filled_by_other_code_is_continued_without_a_history():
    model = tiny.llama_model()
    cache = make_prompt_cache(model)
    for _ in generate_step(mx.array(TURN1), model, max_tokens=5, prompt_cache=cache):
        pass
    assert history(cache) is None
    got, _ = traced(model, NGramDrafter(min_n=1), TURN2, 15, prompt_cache=cache)
    assert history(cache) is None  # what it held before is unknown, so it stays unknown
    assert len(got) == 15


def store_turns(model, store, drafter, prompts, n=12):
    """Each prompt as a request: fetch from the store, generate, put back. Returns outputs and hits."""
    outs, hits = [], []
    for prompt in prompts:
        cache, hit = store.fetch(prompt)
        out = [r.token for r in mlx_spec.stream_generate(model, tiny.tokenizer(), prompt[hit:], drafter,
                                                          max_tokens=n, prompt_cache=cache)]
        store.put(cache)
        outs.append(out)
        hits.append(hit)
    return outs, hits


@pytest.mark.parametrize("name", ["llama", "hybrid", "window"])
def test_the_store_serves_the_longest_prefix_and_the_output_never_changes(name):
    model = {"llama": tiny.llama_model, "hybrid": tiny.qwen3_5_model,
             "window": lambda: tiny.gemma3_model(window=8)}[name]()
    store = PromptCacheStore(model)
    a1 = TURN1
    out, hits = store_turns(model, store, NGramDrafter(min_n=1), [a1])
    a2 = a1 + out[0] + TURN2  # the next turn of the conversation
    b = a1[:6] + [40, 41, 42]  # another conversation sharing a prefix with the first
    outs, hits = store_turns(model, store, NGramDrafter(min_n=1), [a2, b])
    assert outs == [reference(model, a2, 12), reference(model, b, 12)]
    assert hits[0] == len(a1) + 12  # the whole first turn, its output included
    # A shared prefix inside an entry needs trimming, which recurrent state cannot do.
    assert hits[1] == (0 if name == "hybrid" else 6)


def test_the_store_stays_within_its_byte_budget_least_recently_used_first():
    model = tiny.llama_model()
    probe = PromptCacheStore(model)
    store_turns(model, probe, None, [TURN1])
    one = probe.nbytes
    store = PromptCacheStore(model, max_bytes=int(2.5 * one))
    prompts = [[10 + i] + TURN1[1:] for i in range(3)]
    store_turns(model, store, None, prompts)
    assert len(store) == 2 and store.nbytes <= store.max_bytes
    assert store.fetch(prompts[0] + [1])[1] == 0  # the oldest went first
    assert store.fetch(prompts[2] + [1])[1] == len(prompts[2])


def test_fetched_caches_are_private_copies():
    model = tiny.llama_model()
    store = PromptCacheStore(model)
    outs, _ = store_turns(model, store, None, [TURN1])
    held = TURN1 + outs[0]
    c1, n1 = store.fetch(held + [3])
    list(mlx_spec.stream_generate(model, tiny.tokenizer(), [3, 4, 5], max_tokens=5, prompt_cache=c1))
    c2, n2 = store.fetch(held + [7])
    assert n1 == n2 == len(held)
    got = [r.token for r in mlx_spec.stream_generate(model, tiny.tokenizer(), [7], max_tokens=8,
                                                      prompt_cache=c2)]
    assert got == reference(model, held + [7], 8)
    assert np.isfinite(store.nbytes)


def test_the_byte_budget_counts_what_window_layers_hold():
    """A window layer's `state` is its rows in use; its buffer (the bytes the store keeps) is
    larger. The store counts the buffers: the budget was exceeded twice over on a window model."""
    from mlx.utils import tree_flatten

    from mlx_spec.prompt_cache import _layers

    model = tiny.gemma3_model(window=8)
    store = PromptCacheStore(model)
    store_turns(model, store, None, [TURN1])
    caches = [cache for _, cache, _ in store._entries]
    held = sum(a.nbytes for cache in caches for c in _layers(cache)
               for a in ((c.keys, c.values) if c.keys is not None else ()))
    in_use = sum(getattr(a, "nbytes", 0) for cache in caches for c in _layers(cache) for _, a in tree_flatten(c.state))
    assert store.nbytes == held > in_use
