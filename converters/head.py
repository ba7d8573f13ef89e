"""`mlx-spec convert head SRC OUT --target TARGET [--format ...]`: import a drafter head.

Each format registers a converter module in `FORMATS`; `auto` asks each
module's `detect(config, tensor_names) -> bool` in order. A converter module
exposes `convert(src_folder, out_dir, target_folder, *, quantize_bits, force)`,
and optionally `unsupported(config, tensor_names) -> str | None`, the reason a
layout it recognises cannot be loaded (asked before any `detect`).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

# format name -> converter module (checked in this order by --format auto)
# (DSpark before DFlash: a DSpark head is a DFlash backbone plus its own heads.)
FORMATS: dict[str, str] = {
    "gemma4": "converters.gemma4",  # Gemma 4 assistants (told apart by their model_type)
    "dspark": "converters.dspark",
    "dflash": "converters.dflash",
    "mtp": "converters.mtp",  # MTP modules inside target checkpoints
    "eagle3": "converters.eagle.v3",
    "eagle": "converters.eagle.v1",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("src", help="checkpoint folder or Hugging Face repo id")
    parser.add_argument("out", type=Path, help="output folder (must not exist unless --force)")
    parser.add_argument("--target", help="the target the head drafts for: a model folder, Hugging Face "
                        "repo id or zoo name")
    parser.add_argument("--format", default="auto", help="auto (default) or one of: " + ", ".join(FORMATS))
    parser.add_argument("-q", "--quantize", action="store_true", help="quantize the head's Linear weights")
    parser.add_argument("--q-bits", type=int, default=4, choices=(4, 8))
    parser.add_argument("--q-group-size", type=int, default=64)
    parser.add_argument("--force", action="store_true", help="replace OUT if it exists")


def detect(src: Path) -> str:
    from .common import read_config

    config = read_config(src)
    names = _tensor_names(src)
    for module in FORMATS.values():
        reason = getattr(importlib.import_module(module), "unsupported", lambda c, n: None)(config, names)
        if reason:
            raise ValueError(f"{src}: {reason}")
    for name, module in FORMATS.items():
        if importlib.import_module(module).detect(config, names):
            return name
    raise ValueError(
        f"{src}: cannot tell the head format from its config and tensor names; "
        f"pass --format (one of {', '.join(FORMATS)})"
    )


def _tensor_names(folder: Path) -> set[str]:
    from .common import read_tensors

    return set(read_tensors(folder))


def run(args: argparse.Namespace) -> int:
    from .common import ConversionError, resolve_source

    try:
        src = resolve_source(args.src)
        fmt = detect(src) if args.format == "auto" else args.format
        if fmt not in FORMATS:
            raise ValueError(f"unknown --format {fmt!r}; known: auto, {', '.join(FORMATS)}")
        module = importlib.import_module(FORMATS[fmt])
        out = module.convert(
            src, args.out, _zoo_or(args.target),
            quantize_bits=args.q_bits if args.quantize else None,
            group_size=args.q_group_size, force=args.force,
        )
    except (ConversionError, ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (TypeError, AttributeError, KeyError) as e:  # a config field of another type than the format's
        print(f"error: {args.src}: its config.json has a field this head format does not take, or "
              f"of another type ({type(e).__name__}: {e}); check --format and the checkpoint",
              file=sys.stderr)
        return 2
    print(out)
    return 0


def _zoo_or(target: str | None) -> str | None:
    """A zoo name as its (fetched) folder, as every other command takes it; else as given."""
    from mlx_spec import zoo

    if target not in zoo.MODELS:
        return target
    try:
        return str(zoo.fetch(target))
    except zoo.ZooError as e:
        raise ValueError(f"--target {target}: {e}") from None
