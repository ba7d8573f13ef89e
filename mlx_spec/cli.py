"""The `mlx-spec` command line: one subcommand per job.

Each subcommand lives in its own module exposing `add_arguments(parser)` and
`run(args) -> int`. Only the chosen command's module is imported, and heavy
imports (mlx, mlx-lm) happen inside `run`, so `--help` stays instant.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import traceback

from .load_errors import ModelLoadError

# name -> (module, help). "convert" has kinds of its own, below.
COMMANDS = {
    "generate": ("mlx_spec.generate_cli", "generate text with speculative decoding"),
    "fetch-model": ("mlx_spec.zoo", "download and convert a pinned zoo model"),
    "bench": ("mlx_spec.bench", "measure speed-ups of every method side by side"),
    "serve": ("mlx_spec.server.cli", "serve a model over OpenAI's and Anthropic's HTTP APIs"),
    "launch": ("mlx_spec.launch", "run generate, bench or serve on several ranks (a sharded target) via mlx.launch"),
    "train": ("mlx_spec.train.cli", "train or realign an EAGLE-3 draft head on this machine"),
}
CONVERTERS = {
    "gguf": ("converters.gguf", "convert a GGUF file into an MLX model folder"),
    "head": ("converters.head", "import an EAGLE/MTP/DFlash/DSpark drafter head"),
}


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    """The parser, with arguments attached only for the command `argv` names."""
    words = [a for a in argv if not a.startswith("-")]
    parser = argparse.ArgumentParser(
        prog="mlx-spec", description="Lossless speculative decoding with MLX."
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (module, help_) in COMMANDS.items():
        p = sub.add_parser(name, help=help_, description=help_)
        if words[:1] == [name]:
            _attach(p, module)
    convert = sub.add_parser("convert", help="convert checkpoints into MLX folders")
    kinds = convert.add_subparsers(dest="kind", metavar="KIND", required=True)
    for name, (module, help_) in CONVERTERS.items():
        p = kinds.add_parser(name, help=help_, description=help_)
        if words[:2] == ["convert", name]:
            _attach(p, module)
    return parser


def _attach(parser: argparse.ArgumentParser, module_name: str) -> None:
    module = importlib.import_module(module_name)
    module.add_arguments(parser)
    parser.set_defaults(_run=module.run)


def main(argv: list[str] | None = None) -> int:
    if argv is None:  # a real command-line run (not a call from Python): go fast on Linux
        from .fastblas import restart_with_fast_blas

        restart_with_fast_blas()
        # transformers (imported by mlx-lm for its tokenizers) advises installing PyTorch on
        # import; nothing here uses PyTorch, so that line would only mislead
        os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(argv).parse_args(argv)
    try:
        return args._run(args) or 0
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except ModelLoadError as e:  # any command: one line naming the file and the fix
        return report(e, args)
    except RuntimeError as e:  # a sharded run whose peer ended or failed: MLX's ring says so
        if getattr(args, "shard", None) is None:
            raise
        return report(RuntimeError(f"stopped: {e} (if another rank ended or failed, its own "
                                   "error says why)"), args)


def _rank() -> str:
    """'rank N: ' in a process mlx.launch started (from its environment: asking MLX for the
    group could wait on peers that are gone), else ''."""
    rank = os.environ.get("MLX_RANK")
    return f"rank {rank}: " if rank is not None else ""


def report(error: Exception, args: argparse.Namespace) -> int:
    """Print `error` as one `error: ...` line on stderr (after its traceback when the
    command was given an explicit --verbose); the exit code is 2."""
    if getattr(args, "verbose", None) is True:
        traceback.print_exception(error)
    where = _rank() if getattr(args, "shard", None) is not None and not str(error).startswith("rank ") else ""
    print(f"error: {where}{error}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
