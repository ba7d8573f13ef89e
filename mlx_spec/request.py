"""One generation request, checked before any model work.

`make_request` turns `stream_generate`'s keyword arguments into a `Request`
(or raises a clear `ValueError` / `TypeError`), reading them as mlx-lm reads
its own: `max_tokens=-1` is no limit, `top_p` 0 or 1 is no nucleus filter, a
string prompt is encoded with special tokens unless it starts with BOS, and
the cache options (`max_kv_size`, `kv_bits`, `kv_group_size`,
`quantized_kv_start`, `prefill_step_size`) mean what they mean in mlx-lm's
`generate_step`. The server and the batch loop build the same `Request`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import mlx.core as mx

from .cache import MAX_DRAFT
from .identity import IdentityMap
from .sampling import Sampling

PREFILL_STEP = 2048  # mlx-lm's prefill_step_size default
QUANTIZED_KV_START = 5000  # mlx-lm's quantized_kv_start default


@dataclass(frozen=True)
class Request:
    prompt: tuple[int, ...] = ()
    max_tokens: int | None = None  # None: no limit (mlx-lm's -1)
    sampling: Sampling = Sampling()
    num_draft_tokens: int | str = "auto"
    seed: int | None = None
    logits_processors: tuple = ()
    prompt_progress_callback: Callable[[int, int], None] | None = None
    prefill_step_size: int = PREFILL_STEP
    max_kv_size: int | None = None
    kv_bits: int | None = None
    kv_group_size: int = 64
    quantized_kv_start: int = QUANTIZED_KV_START
    trace: bool = False

    @property
    def repeatable(self) -> bool:
        """A seeded sampled request: its draft lengths may depend on the tokens and the
        calibration only, never on timings or on what earlier requests taught the policy,
        because they decide which random draws the text is made of. Greedy text is the
        target's own whatever the draft lengths, so a seed changes nothing there."""
        return self.seed is not None and not self.sampling.greedy

    def quantize_cache(self, cache: list) -> None:
        """mlx-lm's KV quantization: KVCache layers past `quantized_kv_start` become quantized."""
        if self.kv_bits is not None:
            from mlx_lm.generate import maybe_quantize_kv_cache

            maybe_quantize_kv_cache(cache, self.quantized_kv_start, self.kv_group_size, self.kv_bits)


# Keywords of mlx-lm's stream_generate / generate_step that cannot work here, and why.
REFUSED = {
    "sampler": "a sampler function only draws tokens, and rejection sampling needs the "
               "distribution it draws from; pass temp=, top_p=, top_k=, min_p= instead "
               "(read exactly as mlx-lm's make_sampler reads them)",
    "input_embeddings": "drafters propose token ids, so the prompt must be token ids",
}


def refuse_unsupported(unsupported: dict) -> None:
    for name in unsupported:
        why = REFUSED.get(name)
        if why is not None:
            raise TypeError(f"{name}= is not supported by mlx-spec: {why}")
    if unsupported:
        raise TypeError(
            f"unexpected keyword argument(s) {', '.join(sorted(unsupported))}; supported: "
            "draft_model, max_tokens, num_draft_tokens, temp, top_p, top_k, min_p, seed, "
            "prompt_cache, max_kv_size, kv_bits, kv_group_size, quantized_kv_start, "
            "prefill_step_size, logits_processors, prompt_progress_callback, trace"
        )


def make_request(model, tokenizer, prompt, *, max_tokens=256, num_draft_tokens="auto",
                 temp=0.0, top_p=1.0, top_k=0, min_p=0.0, seed=None, logits_processors=None,
                 prompt_progress_callback=None, prefill_step_size=PREFILL_STEP,
                 max_kv_size=None, kv_bits=None, kv_group_size=64,
                 quantized_kv_start=QUANTIZED_KV_START, trace=False) -> Request:
    from .drafters.base import vocab_size

    ids = encode(tokenizer, prompt)
    bad = [t for t in ids if not 0 <= t < vocab_size(model)]
    if bad:
        raise ValueError(f"prompt token id(s) {bad[:3]} are outside the model's vocabulary "
                         f"(0..{vocab_size(model) - 1})")
    if not whole(max_tokens) or max_tokens == 0 or max_tokens < -1:
        raise ValueError(f"max_tokens must be an integer >= 1, or -1 for no limit; got {max_tokens!r}")
    check_num_draft(num_draft_tokens)
    for name, value, low in (("prefill_step_size", prefill_step_size, 1),
                             ("max_kv_size", max_kv_size, 8), ("kv_group_size", kv_group_size, 1),
                             ("quantized_kv_start", quantized_kv_start, 0)):
        if value is not None and not (whole(value) and value >= low):
            raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    if kv_bits is not None and (not whole(kv_bits) or kv_bits not in (2, 3, 4, 5, 6, 8)):
        raise ValueError(f"kv_bits must be one of 2, 3, 4, 5, 6, 8 (or None), got {kv_bits!r}")
    if seed is not None and not whole(seed):
        raise ValueError(f"seed must be an integer, got {seed!r}")
    processors = tuple(logits_processors or ())
    if not all(callable(p) for p in processors):
        raise TypeError("logits_processors must be callables (tokens, logits) -> logits")
    return Request(tuple(ids), None if max_tokens == -1 else max_tokens,
                   Sampling(temp, top_p, top_k, min_p), num_draft_tokens, seed, processors,
                   prompt_progress_callback, prefill_step_size, max_kv_size, kv_bits,
                   kv_group_size, quantized_kv_start, trace)


def encode(tokenizer, prompt) -> list[int]:
    """Token ids of `prompt`: text is encoded as mlx-lm does (special tokens unless it starts with BOS)."""
    if isinstance(prompt, str):
        bos = tokenizer.bos_token
        ids = tokenizer.encode(prompt, add_special_tokens=bos is None or not prompt.startswith(bos))
    elif isinstance(prompt, mx.array):
        if prompt.ndim == 2 and prompt.shape[0] == 1:
            prompt = prompt[0]
        if prompt.ndim != 1:
            raise ValueError(f"a prompt array must be 1-D token ids (or [1, T]), got shape {prompt.shape}")
        ids = prompt.tolist()
    elif isinstance(prompt, Sequence) or hasattr(prompt, "tolist"):
        ids = prompt.tolist() if hasattr(prompt, "tolist") else list(prompt)
    else:
        raise TypeError(f"prompt must be a string or token ids, got {type(prompt).__name__}")
    if not all(isinstance(t, int) or hasattr(t, "__index__") for t in ids):
        raise ValueError("a token-id prompt must hold integers only")
    ids = [int(t) for t in ids]
    if not ids:
        raise ValueError("the prompt is empty: give at least one token of text")
    return ids


def whole(value) -> bool:
    """An integer argument, not a bool (True is an int to Python)."""
    return isinstance(value, int) and not isinstance(value, bool)


def check_num_draft(num_draft_tokens) -> None:
    if num_draft_tokens == "auto":
        return
    if not (whole(num_draft_tokens) and 1 <= num_draft_tokens <= MAX_DRAFT):
        raise ValueError(
            f'num_draft_tokens must be "auto" or an integer in 1..{MAX_DRAFT}, '
            f"got {num_draft_tokens!r}"
        )


_DRAFTERS_OF_MODELS = IdentityMap()  # draft model -> its DraftModelDrafter (keeps what auto k learned)


def resolve_drafter(drafter, draft_model, claims):
    """The drafter to use: `drafter`, or one around `draft_model` (mlx-lm's keyword)."""
    if draft_model is not None:
        if drafter is not None:
            raise ValueError("give either a drafter or draft_model=, not both")
        from .drafters import DraftModelDrafter

        drafter = _DRAFTERS_OF_MODELS.setdefault(draft_model, lambda: DraftModelDrafter(draft_model))
        try:
            claims.check(drafter, "drafter")
        except RuntimeError:  # another live generator drafts with this model: use a new drafter
            drafter = DraftModelDrafter(draft_model)
    if drafter is None:
        return None
    if all(callable(getattr(drafter, m, None)) for m in ("bind", "prefill", "propose", "commit")):
        return drafter
    hint = ""
    if isinstance(drafter, int):
        hint = " (mlx-lm's 4th positional argument is max_tokens; here pass max_tokens= by keyword)"
    elif callable(getattr(drafter, "parameters", None)):
        hint = " (for a draft model pass draft_model=model or DraftModelDrafter(model))"
    raise TypeError(
        f"drafter must be a drafter such as NGramDrafter(), DraftModelDrafter(model) or "
        f"load_drafter(folder, model), got {type(drafter).__name__}{hint}"
    )
