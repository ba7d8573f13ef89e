"""`mlx-spec serve`: an OpenAI- and Anthropic-compatible server with speculative decoding.

With no `--model` it serves the same default as `mlx-spec generate` (the zoo's
SmolLM2-135M-Instruct, fetched on first use, drafting with prompt lookup).
`--model`, `--draft`, `--draft-model` and `--num-draft-tokens` mean what they
mean for `mlx-spec generate`. It prints the URL and the model id once it
listens, and stops cleanly on Ctrl-C or SIGTERM. Needs the `server` extra
(Starlette and uvicorn); docs/server.md has the endpoints and every field.

With `--shard` (under `mlx-spec launch`), rank 0 serves and the other ranks run
the same engine loop without HTTP, applying the plan rank 0 sends before each
step; rank 0 closing ends them (server/link.py, docs/distributed.md).
"""

from __future__ import annotations

import argparse
import importlib.util
import sys

from ..generate_cli import (DEFAULT_MODEL, WITH_DRAFT_MODEL, _k, add_cache_arguments, add_dist_timeout,
                            add_draft_model_arguments, ranged)

LOOPBACK = ("127.0.0.1", "localhost", "::1")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help=f"model folder, Hugging Face repo or zoo name (default: {DEFAULT_MODEL}); "
                   "requests name it by this string")
    p.add_argument("--draft", default=None,
                   help="drafter: ngram (default), none, mtp, dspark, or a converted head folder; with "
                   "--draft-model: model (the draft model alone, the default) or ngram+model")
    add_draft_model_arguments(p)
    p.add_argument("--branches", type=int, default=1,
                   help="draft trees: up to this many candidates per position; 1 (default) drafts chains")
    p.add_argument("--tree-budget", type=int, default=None, metavar="N",
                   help="draft trees of N nodes (1..16) a step: EAGLE-2 dynamic trees with --draft-model, an "
                   "EAGLE head or --draft mtp, DDTree-style trees with a DFlash or DSpark head; default: chains")
    p.add_argument("--num-draft-tokens", type=_k, default="auto",
                   help="default draft length: 1..16, or auto (default); requests may set their own")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default: 127.0.0.1, this machine only)")
    p.add_argument("--port", type=ranged(int, 0, 65535), default=8080,
                   help="port (default: 8080; 0 picks a free one)")
    p.add_argument("--api-key", default=None,
                   help="require this key (Authorization: Bearer KEY or x-api-key: KEY)")
    p.add_argument("--max-batch", type=int, default=4,
                   help="requests decoded together, verified in one forward (default: 4; 1: one "
                   "at a time)")
    p.add_argument("--max-queue", type=int, default=16,
                   help="requests that may wait while others decode; more get 429 (default: 16)")
    p.add_argument("--prompt-cache-bytes", type=_size, default=1 << 30,
                   help="memory for cached conversations, e.g. 512M or 4G; 0 turns the cache off "
                   "(default: 1G)")
    p.add_argument("--shard", choices=("pipeline", "tensor"), default=None,
                   help="split the target over the ranks of `mlx-spec launch` / mlx.launch; rank 0 "
                   "serves HTTP and the others decode with it, step by step")
    add_cache_arguments(p)  # for every request; batched (unlike mlx_lm.server with --kv-bits)
    add_dist_timeout(p)
    p.add_argument("--verbose", action="store_true", help="log every request, and tracebacks")


def _size(value: str) -> int:
    units = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    text = value.strip().upper().removesuffix("B")
    number, unit = (text[:-1], text[-1]) if text and text[-1] in units else (text, "")
    try:
        size = int(float(number) * units[unit])
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a size such as 512M or 4G, got {value!r}") from None
    if size < 0:
        raise argparse.ArgumentTypeError(f"a size cannot be negative, got {value!r}")
    return size


def run(args: argparse.Namespace) -> int:
    missing = [m for m in ("starlette", "uvicorn") if importlib.util.find_spec(m) is None]
    if missing:
        print(f"error: mlx-spec serve needs the server extra ({', '.join(missing)} not installed); "
              "in a checkout: `pip install -e '.[server]'`", file=sys.stderr)
        return 2
    if args.host not in LOOPBACK and not args.api_key:
        print(f"warning: listening on {args.host} without --api-key: anyone who can reach this "
              "machine can use the model; give --api-key KEY (or bind 127.0.0.1)", file=sys.stderr)
    if args.draft not in WITH_DRAFT_MODEL and args.draft_model is not None:
        print(f"error: --draft {args.draft} and --draft-model are alternatives (--draft ngram+model or "
              "--draft model go with --draft-model); give one", file=sys.stderr)
        return 2
    if args.max_queue < 0:
        print("error: --max-queue must be 0 or more", file=sys.stderr)
        return 2
    if args.max_batch < 1:
        print("error: --max-batch must be 1 or more", file=sys.stderr)
        return 2
    try:
        return _serve(args)
    except (ValueError, FileNotFoundError) as e:
        from ..cli import report

        return report(e, args)


def _serve(args) -> int:
    import logging
    import signal

    import mlx_spec

    from ..generate_cli import cache_options, make_drafter, resolve_model
    from .app import Server, create_app
    from .engine import Engine

    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(message)s")
    logging.getLogger("mlx_spec").setLevel(logging.INFO)  # progress notes such as calibration
    model_path = resolve_model(args.model)
    link = None
    if args.shard is not None:
        from .. import distributed
        from ..generate_cli import _load_sharded
        from .link import Link

        model, tokenizer = _load_sharded(model_path, args.shard, logging.getLogger("mlx_spec"),
                                         args.dist_timeout)
        link = Link(distributed.shard_of(model).group)
    else:
        model, tokenizer = mlx_spec.load(model_path)
    drafter = make_drafter(args, model, model_path)
    stop = []  # set when the engine loop dies (a lost rank): the server then shuts down
    engine = Engine(model, tokenizer, drafter, model_id=args.model, num_draft_tokens=args.num_draft_tokens,
                    max_queue=args.max_queue, prompt_cache_bytes=args.prompt_cache_bytes,
                    max_batch=args.max_batch, link=link, cache_options=cache_options(args),
                    on_fatal=lambda e: [setattr(s, "should_exit", True) for s in stop]).start()
    if link is not None and not link.leader:
        error = engine.wait()  # mirrors rank 0's steps until rank 0 closes
        if error is not None:
            print(f"error: rank {link.rank}: {type(error).__name__}: {error}", file=sys.stderr)
        _leave(1 if error is not None else 0)
    host = f"[{args.host}]" if ":" in args.host else args.host

    def ready(port: int) -> None:
        print(f"mlx-spec serve: model {args.model!r} (drafter: {engine.drafter_kind or 'none'}, "
              f"draft length {args.num_draft_tokens}) at http://{host}:{port}/v1", flush=True)

    server = Server(create_app(engine, api_key=args.api_key), engine, args.host, args.port,
                    on_ready=ready, log_level="info" if args.verbose else "warning")
    stop.append(server)
    # uvicorn handles Ctrl-C and SIGTERM itself, then raises them again once it has shut down;
    # these handlers take that second signal, so the command ends here with exit code 0.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    server.run()
    engine.close()
    if engine.fatal is not None:
        print(f"error: the engine stopped ({type(engine.fatal).__name__}: {engine.fatal}); "
              "the server shut down", file=sys.stderr)
        code = 1
    else:
        print("mlx-spec serve: stopped", flush=True)
        code = 0 if server.started else 1
    if link is not None:
        _leave(code)
    return code


def _leave(code: int) -> None:
    """End a sharded server's rank now that its work is done. Leaving through the interpreter's
    normal exit, a rank sometimes died of SIGABRT in native teardown ("terminate called
    without an active exception"; MLX 0.32.4 ring backend, its engine thread's streams),
    which the launcher reports as a failed rank."""
    import os

    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
