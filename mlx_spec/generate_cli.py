"""`mlx-spec generate`: speculative decoding from the command line.

Flag names follow `mlx_lm.generate` where they overlap. With no --model it
uses the zoo's SmolLM2-135M-Instruct (fetched on first use); with no drafter
flag it drafts with prompt lookup (n-gram).
"""

from __future__ import annotations

import argparse
import sys

from .cli import report
from .load_errors import ModelLoadError

DEFAULT_MODEL = "smollm2-135m-instruct"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help=f"model folder, Hugging Face repo or zoo name (default: {DEFAULT_MODEL})")
    p.add_argument("--draft", default=None,
                   help="drafter: ngram (default), none, mtp, dspark, or a converted head folder")
    p.add_argument("--draft-model", default=None, help="a small model with the target's tokenizer")
    p.add_argument("--num-draft-tokens", type=_k, default="auto",
                   help="draft length: 1..16, or auto (default: chosen per step from measured costs)")
    p.add_argument("--recalibrate", action="store_true",
                   help="measure this model's verify cost curve again (used by auto)")
    p.add_argument("--prompt", "-p", required=True, help="the prompt text, or - to read stdin")
    p.add_argument("--max-tokens", "-m", type=int, default=256)
    p.add_argument("--temp", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--ignore-chat-template", action="store_true",
                   help="use the prompt as is, without the model's chat template")
    p.add_argument("--verbose", action="store_true", help="also print per-position acceptance")


def _k(value: str):
    if value == "auto":
        return value
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer 1..16 or auto, got {value!r}")


def run(args: argparse.Namespace) -> int:
    if args.draft is not None and args.draft_model is not None:
        print("error: --draft and --draft-model are alternatives; give one", file=sys.stderr)
        return 2
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    try:
        return _generate(args, prompt)
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


def make_drafter(args, model, model_path: str):
    import mlx_spec

    if args.draft_model is not None:
        draft, draft_tok = mlx_spec.load(resolve_model(args.draft_model))
        return mlx_spec.DraftModelDrafter(draft, draft_tok)
    kind = args.draft or "ngram"
    if kind == "none":
        return None
    if kind == "ngram":
        return mlx_spec.NGramDrafter()
    if kind in ("mtp", "dspark"):  # weights inside the target checkpoint
        return mlx_spec.load_drafter(_local_folder(model_path), model, kind=kind)
    from pathlib import Path

    if Path(kind).expanduser().is_dir():
        return mlx_spec.load_drafter(kind, model)
    raise ValueError(
        f"unknown drafter {kind!r}: use ngram, none, mtp, dspark, a converted head "
        "folder (--draft PATH) or --draft-model PATH"
    )


def _generate(args, prompt: str) -> int:
    import logging

    import mlx_spec

    log = logging.getLogger("mlx_spec")  # progress notes (e.g. calibration) on stderr
    log.setLevel(logging.INFO)
    log.addHandler(logging.StreamHandler(sys.stderr))
    if not prompt.strip():
        raise ValueError("the prompt is empty")
    model_path = resolve_model(args.model)
    model, tokenizer = mlx_spec.load(model_path)
    drafter = make_drafter(args, model, model_path)
    if not args.ignore_chat_template and tokenizer.chat_template is not None:
        messages = [{"role": "user", "content": prompt}]
        prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    if args.recalibrate:
        mlx_spec.calibrate(model)
    last = None
    for last in mlx_spec.stream_generate(
        model, tokenizer, prompt, drafter, max_tokens=args.max_tokens,
        num_draft_tokens=args.num_draft_tokens, temp=args.temp, top_p=args.top_p, top_k=args.top_k,
        min_p=args.min_p, seed=args.seed,
    ):
        print(last.text, end="", flush=True)
    s = last.stats
    print("\n" + "=" * 10)
    print(
        f"{s.generation_tps:.2f} tokens/s, {s.generation_tokens} tokens, tau {s.tau:.2f}, "
        f"acceptance {s.acceptance_rate:.1%} ({type(drafter).__name__ if drafter else 'no drafter'})"
    )
    if args.verbose:
        per_pos = " ".join(f"{a:.2f}" for a in s.accepted_per_position)
        print(f"prompt {s.prompt_tokens} tokens @ {s.prompt_tps:.1f} tokens/s; "
              f"acceptance per position: {per_pos or '-'}; peak memory {s.peak_memory:.2f} GB")
    return 0
