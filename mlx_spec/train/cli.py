"""The train command and its jobs (eagle3, realign, export): train draft heads here (docs/training.md).

    mlx-spec train eagle3  --model M --out DIR [--prompts FILE] [--samples N] [--max-length L]
                           [--epochs E | --steps S] [--draft-vocab V] [--tap-layers a,b,c]
                           [--init target|random] [--resume]
    mlx-spec train realign --drafter HEAD_DIR --model M --out DIR [...]
    mlx-spec train export  DIR OUT --layout {midlayer,speculators} --model M
"""

from __future__ import annotations

import argparse
from pathlib import Path


# Flags a run is started with, and their defaults. They default to None in the parser, so that
# `--resume` can tell the ones given (it continues with the run's own settings) from the rest.
def _defaults(samples: int, epochs: float, lr: float) -> dict:
    return dict(samples=samples, eval_prompts=8, max_length=512, epochs=epochs, lr=lr, ttt_steps=7,
                feature_cache_gb=2.0, checkpoint_every=200, log_every=10, eval_k=4, eval_tokens=128, seed=0,
                magpie_topics="chat,code")


def _common(p: argparse.ArgumentParser, samples: int, epochs: float, lr: float) -> None:
    p.add_argument("--model", required=True, help="the target: a folder, Hugging Face repo id or zoo name")
    p.add_argument("--out", required=True, help="output folder: the head, its checkpoints, data and eval.json")
    p.add_argument("--prompts", help="JSONL of {'messages': [...]} or {'prompt': '...'} rows; without it "
                   "the target writes its own prompts from its chat template")
    p.add_argument("--magpie-topics",
                   help="without --prompts: what the target's own prompts ask for, alternating "
                        "(chat, code; default chat,code)")
    p.add_argument("--samples", type=int, help=f"training prompts (default {samples})")
    p.add_argument("--eval-prompts", type=int, help="held-out prompts for the evaluation (default 8)")
    p.add_argument("--max-length", type=int, help="tokens per sequence, prompt included (default 512)")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--epochs", type=float, help=f"passes over the data (default {epochs})")
    g.add_argument("--steps", type=int, help="optimizer steps (one sequence each), instead of --epochs")
    p.add_argument("--lr", type=float, help=f"peak learning rate (default {lr})")
    p.add_argument("--ttt-steps", type=int, help="unrolled training-time-test steps (default 7)")
    p.add_argument("--feature-cache-gb", type=float,
                   help="memory for the target's features kept between epochs, so the target runs "
                        "once per sequence (default 2; 0 recomputes them every epoch)")
    p.add_argument("--checkpoint-every", type=int, help="optimizer steps between checkpoints (default 200)")
    p.add_argument("--log-every", type=int, help="optimizer steps between progress lines (default 10)")
    p.add_argument("--eval-k", type=int, help="draft length of the evaluation (default 4)")
    p.add_argument("--eval-tokens", type=int, help="tokens generated per evaluation prompt (default 128)")
    p.add_argument("--resume", action="store_true", help="continue the run in --out where it stopped, "
                   "with the settings it was started with (but --feature-cache-gb, --log-every, "
                   "--checkpoint-every)")
    p.add_argument("--seed", type=int, help="data order and prompts (default 0)")
    p.set_defaults(defaults=_defaults(samples, epochs, lr))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="job", metavar="JOB", required=True)
    e = sub.add_parser("eagle3", help="train a new EAGLE-3 head for a target",
                       description="Train a new EAGLE-3 head on data the target generates itself.")
    _common(e, samples=1000, epochs=2, lr=3e-4)
    e.add_argument("--draft-vocab", type=int, help="draft vocabulary size (default: min(16384, target's))")
    e.add_argument("--data-from", help="reuse the generated data and held-out prompts of an earlier run's "
                   "folder instead of generating them (e.g. to try other settings)")
    e.add_argument("--init", choices=("target", "random"),
                   help="how the head's output layer starts: as the target's own LM head and final norm, "
                        "cut to the draft vocabulary (default), or random")
    e.add_argument("--tap-layers", help="target layers whose outputs the head reads, e.g. 1,14,26 "
                   "(default: EAGLE-3's low/mid/high: 1, N//2-1, N-4)")
    r = sub.add_parser("realign", help="fine-tune an existing EAGLE-3 head to this target",
                       description="Fine-tune an EAGLE-3 head (e.g. a published one) to the target you run "
                                   "(a quantized conversion, a fine-tune); reports tau before and after.")
    r.add_argument("--drafter", required=True, help="the head folder (from `mlx-spec convert head`)")
    _common(r, samples=2000, epochs=1, lr=1e-4)
    x = sub.add_parser("export", help="write a trained head in a published EAGLE-3 layout",
                       description="Write a head folder in the reference (midlayer) or speculators layout; "
                                   "`mlx-spec convert head` reads both back.")
    x.add_argument("src", help="the trained head folder")
    x.add_argument("dest", help="output folder")
    x.add_argument("--layout", choices=("midlayer", "speculators"), default="midlayer")
    x.add_argument("--model", help="the target (speculators' layout carries a copy of its embedding)")
    x.add_argument("--force", action="store_true", help="replace DEST if it exists")


def _given(args) -> dict:
    """The run-shaping flags given on the command line, by their flag names."""
    names = list(args.defaults) + ["steps", "prompts"]
    names += ["draft_vocab", "data_from", "tap_layers", "init"] if args.job == "eagle3" else []
    given = {"--" + n.replace("_", "-"): getattr(args, n) for n in names if getattr(args, n) is not None}
    if args.job == "realign":
        given["--drafter"] = str(Path(args.drafter).resolve())
    return given


def _taps(text):
    if not text:
        return None
    return [t.strip() if t.strip() == "embed" else int(t) for t in text.split(",")]


def run(args: argparse.Namespace) -> int:
    from ..cli import report
    from ..generate_cli import resolve_model
    from ..load_errors import ModelLoadError

    try:
        if args.job == "export":
            return _export(args)
        from .run import RESUME_MAY_CHANGE, check_resume

        given = _given(args)
        if args.resume:
            check_resume(Path(args.out), args.job, given)  # before the model is even loaded
        for name, value in args.defaults.items():
            if getattr(args, name) is None:
                setattr(args, name, value)
        prompts = args.prompts
        if prompts is not None:
            from .data import read_prompts

            read_prompts(prompts)  # a bad file fails before the model is even loaded
        import mlx_spec

        model, tokenizer = mlx_spec.load(resolve_model(args.model))
        common = dict(prompts=prompts, samples=args.samples, eval_prompts=args.eval_prompts,
                      max_length=args.max_length, epochs=args.epochs, steps=args.steps, resume=args.resume,
                      seed=args.seed, lr=args.lr, ttt_steps=args.ttt_steps,
                      checkpoint_every=args.checkpoint_every, log_every=args.log_every,
                      eval_k=args.eval_k, eval_tokens=args.eval_tokens,
                      feature_cache_gb=args.feature_cache_gb,
                      resume_with={name: given[flag] for flag, name in RESUME_MAY_CHANGE.items() if flag in given}
                      if args.resume else None,
                      topics=tuple(t.strip() for t in args.magpie_topics.split(",") if t.strip()))
        if args.job == "eagle3":
            from .run import train_eagle3

            train_eagle3(model, tokenizer, args.out, draft_vocab=args.draft_vocab, data_from=args.data_from,
                         tap_layers=_taps(args.tap_layers), init=args.init or "target", **common)
        else:
            from .run import realign

            realign(model, tokenizer, args.drafter, args.out, **common)
    except ModelLoadError:
        raise
    except (ValueError, FileNotFoundError) as e:
        return report(e, args)
    print(args.out)
    return 0


def _export(args) -> int:
    from .export import export

    model = None
    if args.model is not None:
        import mlx_spec
        from ..generate_cli import resolve_model

        model, _ = mlx_spec.load(resolve_model(args.model))
    print(export(args.src, args.dest, args.layout, model=model, force=args.force))
    return 0
