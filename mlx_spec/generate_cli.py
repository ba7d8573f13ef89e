"""`mlx-spec generate`: speculative decoding from the command line.

Flags and defaults follow `mlx_lm.generate` (mlx-lm 0.32.2) where they overlap: --prompt
defaults to "hello" ("-" reads stdin), --max-tokens to 100, --extra-eos-token takes several
tokens, --system-prompt goes into the chat template, and --verbose takes mlx-lm's True/False
as well as the bare flag. With no --model it uses the zoo's SmolLM2-135M-Instruct (fetched
on first use); with no drafter flag it drafts with prompt lookup (n-gram). The README's
"Command line" section lists every difference from mlx_lm.generate.
"""

from __future__ import annotations

import argparse
import logging
import sys

from .cli import report
from .load_errors import ModelLoadError

DEFAULT_MODEL = "smollm2-135m-instruct"
WITH_DRAFT_MODEL = (None, "ngram+model", "model")  # --draft values that go with --draft-model
DEFAULT_PROMPT = "hello"  # as mlx_lm.generate
DEFAULT_MAX_TOKENS = 100  # as mlx_lm.generate


def add_cache_arguments(p) -> None:
    """mlx-lm's KV cache options (`generate` and `serve` take the same)."""
    p.add_argument("--max-kv-size", type=ranged(int, 1), default=None,
                   help="keep at most this many positions in the KV cache (the first 4 stay), as mlx-lm")
    p.add_argument("--kv-bits", type=int, choices=(2, 3, 4, 5, 6, 8), default=None,
                   help="quantize the KV cache to this many bits")
    p.add_argument("--kv-group-size", type=int, default=64, help="group size of KV cache quantization")
    p.add_argument("--quantized-kv-start", type=int, default=5000,
                   help="with --kv-bits, quantize the KV cache once it holds this many positions")


def cache_options(args) -> dict:
    return dict(max_kv_size=args.max_kv_size, kv_bits=args.kv_bits, kv_group_size=args.kv_group_size,
                quantized_kv_start=args.quantized_kv_start)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help=f"model folder, Hugging Face repo or zoo name (default: {DEFAULT_MODEL})")
    p.add_argument("--draft", default=None,
                   help="drafter: ngram (default), none, mtp, dspark, a converted head folder; with "
                   "--draft-model: model (the default: the draft model, its chains guided by prompt "
                   "lookup) or ngram+model (prompt lookup and the draft model as two sources)")
    p.add_argument("--branches", type=int, default=1,
                   help="draft trees: up to this many candidates per position (n-gram: earlier "
                   "matches; draft model: its runner-up tokens); 1 (default) drafts chains")
    p.add_argument("--tree-budget", type=int, default=None, metavar="N",
                   help="draft trees of N nodes (1..16) a step: EAGLE-2 dynamic trees with "
                   "--draft-model, an EAGLE head or --draft mtp, DDTree-style trees with a DFlash or DSpark head; "
                   "default: chains")
    add_draft_model_arguments(p)
    p.add_argument("--num-draft-tokens", type=_k, default="auto",
                   help="draft length: 1..16, or auto (default: chosen per step from measured costs)")
    p.add_argument("--recalibrate", action="store_true",
                   help="measure this model's verify cost curve again (used by auto)")
    p.add_argument("--extra-eos-token", nargs="+", default=(), metavar="TOKEN",
                   help="more tokens (as the vocabulary spells them, or ids) that end generation")
    p.add_argument("--system-prompt", default=None, help="system message for the chat template")
    p.add_argument("--prompt", "-p", default=DEFAULT_PROMPT,
                   help=f"the prompt text, or - to read stdin (default: {DEFAULT_PROMPT!r})")
    # what `mlx-spec launch` passes each rank for --prompt -: the text it read from stdin, as it is
    p.add_argument("--prompt-verbatim", default=None, help=argparse.SUPPRESS)
    p.add_argument("--max-tokens", "-m", type=ranged(int, 1), default=DEFAULT_MAX_TOKENS,
                   help=f"most tokens to generate (default: {DEFAULT_MAX_TOKENS})")
    p.add_argument("--temp", type=ranged(float, 0), default=0.0)
    p.add_argument("--top-p", type=ranged(float, 0, 1), default=1.0)
    p.add_argument("--top-k", type=ranged(int, 0), default=0)
    p.add_argument("--min-p", type=ranged(float, 0, 1), default=0.0)
    p.add_argument("--seed", type=int, default=None)
    add_cache_arguments(p)
    p.add_argument("--prefill-step-size", type=ranged(int, 1), default=2048,
                   help="prompt tokens processed at a time (smaller: lower peak memory)")
    p.add_argument("--ignore-chat-template", action="store_true",
                   help="use the prompt as is, without the model's chat template")
    p.add_argument("--compare", action="store_true",
                   help="also decode the prompt plainly (interleaved) and print the measured speed-up")
    p.add_argument("--shard", choices=("pipeline", "tensor"), default=None,
                   help="split the target over the ranks of `mlx-spec launch` / mlx.launch: "
                   "consecutive layers per rank, or every layer's matrices (rank 0 prints)")
    add_dist_timeout(p)
    p.add_argument("--verbose", nargs="?", const=True, default=None, type=_bool, metavar="True|False",
                   help="False: print only the generated text. True or the bare flag: also "
                   "acceptance per draft position, and tracebacks on errors")


def _k(value: str):
    if value == "auto":
        return value
    try:
        k = int(value)
    except ValueError:
        k = None
    if k is None or not 1 <= k <= 16:
        raise argparse.ArgumentTypeError(f"expected an integer 1..16 or auto, got {value!r}")
    return k


def ranged(kind, low=None, high=None):
    """An argparse type: `kind(value)` within [low, high] (either may be None), refused before
    any model is loaded with a message that names the range."""
    import math

    def parse(value: str):
        try:
            x = kind(value)
        except ValueError:
            x = None
        if x is None or (kind is float and not math.isfinite(x)) or (low is not None and x < low) \
                or (high is not None and x > high):
            span = (f"{low}..{high}" if high is not None else f">= {low}") if low is not None else f"<= {high}"
            raise argparse.ArgumentTypeError(f"expected {'an integer' if kind is int else 'a number'} "
                                             f"{span}, got {value!r}")
        return x
    return parse


def _bool(value: str) -> bool:
    """mlx_lm.generate's --verbose values: True/T or False/F (any case); also 1/0, yes/no."""
    word = value.lower()
    if word in ("true", "t", "1", "yes"):
        return True
    if word in ("false", "f", "0", "no"):
        return False
    raise argparse.ArgumentTypeError(f"expected True or False, got {value!r}")


def prompt_text(args: argparse.Namespace) -> str:
    """--prompt with mlx_lm.generate's \\n and \\t escapes, stdin's text for -, or launch's verbatim text."""
    if args.prompt_verbatim is not None:
        return args.prompt_verbatim
    prompt = args.prompt.replace("\\n", "\n").replace("\\t", "\t")
    text = sys.stdin.read() if prompt == "-" else prompt
    if not text.strip():  # (an empty pipe too: answering an empty turn would hide it)
        raise ValueError("the prompt is empty" + (" (nothing came on stdin)" if prompt == "-" else "")
                         + ": give some text with --prompt")
    return text


def run(args: argparse.Namespace) -> int:
    if args.draft not in WITH_DRAFT_MODEL and args.draft_model is not None:
        print(f"error: --draft {args.draft} and --draft-model are alternatives (--draft ngram+model or "
              "--draft model go with --draft-model); give one", file=sys.stderr)
        return 2
    try:
        return _generate(args, prompt_text(args))
    except ModelLoadError:
        raise  # reported by mlx_spec.cli, like every command's load failures
    except (ValueError, FileNotFoundError) as e:
        return report(e, args)


def resolve_model(name: str) -> str:
    """A zoo name becomes its (fetched) folder; anything else is passed through."""
    from . import zoo

    return str(zoo.fetch(name)) if name in zoo.MODELS else name


def _local_folder(model_path: str) -> str:
    """The local folder of a model given by path or Hugging Face repo id (already downloaded)."""
    from pathlib import Path

    if Path(model_path).expanduser().is_dir():
        return model_path
    from huggingface_hub import snapshot_download

    return snapshot_download(model_path, allow_patterns=["*.json", "*.safetensors"])


def add_draft_model_arguments(p: argparse.ArgumentParser) -> None:
    """--draft-model and the options of its drafter (`draft_model_options`), for generate and serve."""
    from .drafters.draft_model import MIN_CONFIDENCE
    from .drafters.short_head import HEAD_VOCAB

    p.add_argument("--draft-model", default=None, help="a small model with the target's tokenizer")
    p.add_argument("--no-lookup", action="store_true",
                   help="with --draft-model: never feed prompt lookup's guess to the draft model "
                   "(by default its chains check the guess in their first forward)")
    p.add_argument("--draft-head-vocab", type=int, default=None, metavar="N",
                   help="with --draft-model: its LM head drafts from the first N token ids and the text's "
                   f"own tokens (default {HEAD_VOCAB}; 0: its whole vocabulary); the output is unchanged")
    p.add_argument("--draft-min-confidence", type=float, default=None, metavar="P",
                   help="with --draft-model: a draft chain ends after a token the draft model gave less "
                   f"than probability P (default {MIN_CONFIDENCE}; 0: chains as long as asked); the output "
                   "is unchanged")


def draft_model_options(args) -> dict:
    """`DraftModelDrafter`'s `head_vocab` and `min_confidence` from --draft-head-vocab and
    --draft-min-confidence (0: off; none given: its defaults)."""
    out = {}
    n = getattr(args, "draft_head_vocab", None)
    if n is not None:
        if n < 0:
            raise ValueError(f"--draft-head-vocab must be 0 (the whole vocabulary) or a positive count, got {n}")
        out["head_vocab"] = n or None
    p = getattr(args, "draft_min_confidence", None)
    if p is not None:
        if not 0 <= p <= 1:
            raise ValueError(f"--draft-min-confidence must be a probability in [0, 1] (0: chains as long as "
                             f"asked), got {p}")
        out["min_confidence"] = p or None
    return out


def make_drafter(args, model, model_path: str):
    """The drafter the arguments name. A draft model given without --draft drafts alone, its
    chains guided by prompt lookup (`DraftModelDrafter(lookup=True)`: on the Qwen2.5-Coder
    pair ahead of prompt lookup alone and of the mixed drafter on every suite,
    docs/benchmarks.md); --draft ngram+model adds prompt lookup as a source of its own."""
    import mlx_spec

    branches, budget = getattr(args, "branches", 1), getattr(args, "tree_budget", None)
    given = [flag for flag, name in (("--draft-head-vocab", "draft_head_vocab"),
                                     ("--draft-min-confidence", "draft_min_confidence"))
             if getattr(args, name, None) is not None]
    if given and args.draft_model is None:
        raise ValueError(f"{' and '.join(given)} set the draft model's drafter: give --draft-model PATH "
                         "too, or leave them out")
    if getattr(args, "draft_min_confidence", None) and (branches != 1 or budget is not None):
        raise ValueError("--draft-min-confidence ends draft chains early; trees (--branches, --tree-budget) "
                         "are drafted whole: leave one of them out")
    if args.draft_model is not None:
        draft, draft_tok = mlx_spec.load(resolve_model(args.draft_model))
        model_drafter = mlx_spec.DraftModelDrafter(draft, draft_tok, branches=branches, tree_budget=budget,
                                                   lookup=not getattr(args, "no_lookup", False), **draft_model_options(args))
        if args.draft == "ngram+model":
            return mlx_spec.MixedDrafter(mlx_spec.NGramDrafter(branches=branches), model_drafter)
        return model_drafter
    if args.draft in ("ngram+model", "model"):
        raise ValueError(f"--draft {args.draft} needs --draft-model PATH (the model)")
    kind = args.draft or "ngram"
    tree_budget = getattr(args, "tree_budget", None)  # block drafters (head folders, dspark)
    if tree_budget is not None and kind in ("none", "ngram"):
        raise ValueError(f"--tree-budget drafts trees with a draft model (--draft-model PATH), an EAGLE "
                         f"or MTP head or a block drafter (a DFlash or DSpark head: --draft PATH, --draft "
                         f"mtp or --draft dspark), not with --draft {kind}")
    options = {} if tree_budget is None else {"tree_budget": tree_budget}
    if branches != 1 and kind != "ngram":
        raise ValueError(f"--branches drafts trees with the n-gram and draft-model drafters; "
                         f"--draft {kind} drafts chains (leave --branches out)")
    if kind == "none":
        return None
    if kind == "ngram":
        return mlx_spec.NGramDrafter(branches=branches)
    if kind in ("mtp", "dspark"):  # weights inside the target checkpoint
        drafter = mlx_spec.load_drafter(_local_folder(model_path), model, kind=kind, **options)
        k = getattr(args, "num_draft_tokens", "auto")
        if isinstance(k, int) and k > drafter.max_draft and hasattr(drafter, "set_block"):
            drafter.set_block(k)  # DeepSeek-V4 DSpark: vLLM's num_speculative_tokens k
        return drafter
    from pathlib import Path

    if Path(kind).expanduser().is_dir():
        return mlx_spec.load_drafter(kind, model, **options)
    raise ValueError(
        f"unknown drafter {kind!r}: use ngram, none, mtp, dspark, a converted head "
        "folder (--draft PATH) or --draft-model PATH"
    )


def _generate(args, prompt: str) -> int:
    import mlx_spec

    log = logging.getLogger("mlx_spec")  # progress notes (e.g. calibration) on stderr
    log.setLevel(logging.INFO)
    log.addHandler(logging.StreamHandler(sys.stderr))
    model_path = resolve_model(args.model)
    if args.shard is not None:
        model, tokenizer = _load_sharded(model_path, args.shard, log, args.dist_timeout)
    else:
        model, tokenizer = mlx_spec.load(model_path)
    for token in args.extra_eos_token:
        add_eos_token(tokenizer, token)
    drafter = make_drafter(args, model, model_path)
    ids = encode_prompt(tokenizer, prompt, args.system_prompt, not args.ignore_chat_template)
    if args.recalibrate:
        mlx_spec.calibrate(model)
    show = args.verbose is not False
    if show:
        print("=" * 10)
    options = dict(max_tokens=args.max_tokens, num_draft_tokens=args.num_draft_tokens, temp=args.temp,
                   top_p=args.top_p, top_k=args.top_k, min_p=args.min_p, seed=args.seed,
                   prefill_step_size=args.prefill_step_size, **cache_options(args))
    text, last, shown = "", None, []
    for last in mlx_spec.stream_generate(model, tokenizer, ids, drafter, **options):
        print(last.text, end="", flush=True)
        text += last.text
        shown.append(last.token)
    print()
    if show:
        _summary(last.stats, drafter, args, empty=not text)
    if args.compare:
        _compare(model, tokenizer, ids, drafter, options, last, shown)
    return 0


def _compare(model, tokenizer, ids, drafter, options, first, shown: list[int]) -> None:
    """The same prompt decoded plainly and speculatively again, twice each (plain, speculative,
    speculative, plain: drift over the runs weighs on both alike), and the speed-up. The run
    shown (`first`, its tokens `shown`) is not counted: it was the speculative path's first,
    paying one-time costs; a short plain run pays the plain path's before the counted ones."""
    import mlx_spec

    list(mlx_spec.stream_generate(model, tokenizer, ids, None, **{**options, "max_tokens": 8}))
    runs = {"plain": [], "speculative": []}
    tokens = {}
    for name, d in (("plain", None), ("speculative", drafter), ("speculative", drafter), ("plain", None)):
        out = list(mlx_spec.stream_generate(model, tokenizer, ids, d, **options))
        runs[name].append(out[-1].stats.generation_tps)
        tokens[name] = [r.token for r in out]
    plain = sum(runs["plain"]) / 2
    spec = sum(runs["speculative"]) / 2
    same = "same tokens" if tokens["plain"] == tokens["speculative"] == shown else "other tokens (sampled)"
    print(f"Compare: plain {plain:.2f} tokens-per-sec, speculative {spec:.2f} tokens-per-sec: "
          f"{spec / plain:.2f}x ({same}; after the run shown: plain, speculative, speculative, plain)")


def add_dist_timeout(p: argparse.ArgumentParser) -> None:
    from .watchdog import DEFAULT_TIMEOUT

    p.add_argument("--dist-timeout", type=ranged(float, 0), default=DEFAULT_TIMEOUT, metavar="SECONDS",
                   help="with --shard: a rank that waits this long for the others (connecting, "
                   f"or in a forward) ends with an error naming it (default {DEFAULT_TIMEOUT:g}; "
                   "0: wait forever)")


def _load_sharded(model_path: str, mode: str, log, timeout: float | None = None):
    """This rank's part of the target; ranks other than 0 print nothing on stdout."""
    import os

    from . import distributed

    group = distributed.init(timeout=timeout)
    model, tokenizer = distributed.load(model_path, mode, group)
    layout = distributed.describe(model)  # every rank takes part
    if group.rank() != 0:
        sys.stdout = open(os.devnull, "w")
        log.setLevel(logging.WARNING)
    else:
        print(layout, file=sys.stderr)
    return model, tokenizer


def encode_prompt(tokenizer, prompt: str, system: str | None, chat: bool) -> list[int]:
    """The prompt's token ids as mlx_lm.generate makes them: the chat template (with the
    system message) when the tokenizer has one, special tokens only without it."""
    use_template = chat and tokenizer.has_chat_template
    if use_template:
        messages = [{"role": "system", "content": system}] if system is not None else []
        messages.append({"role": "user", "content": prompt})
        prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    elif system is not None:
        print("note: --system-prompt is ignored without a chat template", file=sys.stderr)
    return tokenizer.encode(prompt, add_special_tokens=not use_template)


def add_eos_token(tokenizer, token: str) -> None:
    """Stop at `token` too (a vocabulary entry or an id), refusing what is not a token."""
    vocab = tokenizer.get_vocab()
    known = token in vocab or (token.isdigit() and int(token) < max(len(vocab), tokenizer.vocab_size))
    if not known:
        raise ValueError(
            f"--extra-eos-token {token!r} is not a token of this tokenizer; give it as the "
            "vocabulary spells it (e.g. '<|im_end|>') or as a token id"
        )
    tokenizer.add_eos_token(token)


def _summary(s, drafter, args, empty: bool) -> None:
    print("=" * 10)
    if empty:
        print("No text generated for this prompt")
    print(f"Prompt: {s.prompt_tokens} tokens, {s.prompt_tps:.3f} tokens-per-sec")
    print(f"Generation: {s.generation_tokens} tokens, {s.generation_tps:.3f} tokens-per-sec")
    print(f"Peak memory: {s.peak_memory:.3f} GB")
    name = type(drafter).__name__ if drafter is not None else "no drafter"
    print(f"Speculation: tau {s.tau:.2f} tokens per target forward, acceptance "
          f"{s.acceptance_rate:.1%} ({name}, draft length {args.num_draft_tokens})")
    if s.plain_reason == "backlog":
        print("Decoded plainly: reading the prompt into the draft model would have cost more than "
              "drafting could save in the tokens asked for (--max-tokens)")
    if args.verbose is True:
        per_pos = " ".join(f"{a:.2f}" for a in s.accepted_per_position)
        print(f"Accepted per draft position: {per_pos or '-'}")
