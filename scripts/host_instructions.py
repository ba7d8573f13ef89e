"""Instructions per decoded token, per thread: mlx-spec's plain loop against mlx-lm's.

    python scripts/host_instructions.py [--tokens 10,110] [--jobs 2]

Wall-clock ratios of two loops a few percent apart need hundreds of interleaved runs on a
shared machine (`scripts/overhead.py --gpu-like --pairs N`). Instruction counts do not:
valgrind's callgrind counts the instructions each thread executes, the same from run to
run whatever else the machine is doing. This script runs each loop in the GPU-like regime
of `scripts/overhead.py` (30 llama layers of width 64, a real 49k vocabulary: a step costs
its fixed per-step work, as on a fast GPU) under callgrind for two lengths, and prints the
difference divided by the extra tokens: what one more token costs, with loading and
prefill cancelled out. Printed per loop: the main thread (Python: building the graph, and
MLX's CPU backend dispatching each operation to its worker) and the other threads (MLX's
worker evaluating them, OpenBLAS), and each loop's ratio to mlx-lm's `stream_generate`
(which, as mlx-spec's loop, detokenizes and builds a response per token).

On a fast GPU the main thread is the step's host time; here it is also what limits a
step (its CPU time per token is close to the wall time per token). Needs valgrind
(Linux; `apt-get install valgrind`). About 10 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

LOOPS = ("mlx-spec stream_generate", "mlx-lm stream_generate", "mlx-lm generate_step")


def child(loop: str, n: int) -> None:
    """One run of `loop` for `n` tokens on the GPU-like model (under callgrind)."""
    import resource

    # mlx-lm raises its open-file limit on import; valgrind refuses a higher hard limit
    # ("not allowed to raise maximum limit"): the child keeps the limit it has.
    set_limit = resource.setrlimit

    def keep_limit(which, limits):
        try:
            set_limit(which, limits)
        except ValueError:
            pass

    resource.setrlimit = keep_limit
    import mlx.core as mx
    from mlx_lm.generate import generate_step, stream_generate

    import mlx_spec
    from overhead import gpu_like_model

    model, tok = gpu_like_model("smollm2-135m-instruct")
    prompt = [5, 6, 7, 8] * 8
    if loop == "mlx-spec stream_generate":
        count = sum(1 for _ in mlx_spec.stream_generate(model, tok, prompt, None, max_tokens=n))
    elif loop == "mlx-lm stream_generate":
        count = sum(1 for _ in stream_generate(model, tok, prompt, max_tokens=n))
    else:
        count = sum(1 for _ in generate_step(mx.array(prompt), model, max_tokens=n))
    assert count == n, (loop, count, n)


def _threads(out: Path) -> dict[int, int]:
    """Instructions per thread of one callgrind run (`--separate-threads=yes` files)."""
    counts = {}
    for f in out.parent.glob(out.name + "-*"):
        m = re.search(r"^summary: (\d+)", f.read_text(errors="replace"), re.M)
        if m:
            counts[int(f.name.rsplit("-", 1)[1])] = int(m.group(1))
    if not counts:
        raise RuntimeError(f"callgrind wrote no counts for {out.name}")
    return counts


def run(valgrind: str, loop: str, n: int, tmp: Path, env: dict) -> dict[int, int]:
    out = tmp / f"{LOOPS.index(loop)}.{n}"
    cmd = [valgrind, "--tool=callgrind", "--separate-threads=yes", f"--callgrind-out-file={out}",
           sys.executable, __file__, "--child", loop, str(n)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"{loop} ({n} tokens) failed under valgrind:\n{done.stderr[-3000:]}")
    return _threads(out)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", default="10,110", help="the two run lengths (tokens)")
    p.add_argument("--jobs", type=int, default=2, help="valgrind runs at once")
    p.add_argument("--child", nargs=2, metavar=("LOOP", "N"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args.child[0], int(args.child[1]))
        return 0
    valgrind = shutil.which("valgrind")
    if valgrind is None:
        print("host_instructions.py needs valgrind (Linux: apt-get install valgrind)", file=sys.stderr)
        return 2
    short, long = (int(x) for x in args.tokens.split(","))
    if not 3 <= short < long:
        print("--tokens: two lengths, 3 <= short < long (e.g. 10,110)", file=sys.stderr)
        return 2
    from mlx_spec.fastblas import preload_env
    from mlx_spec.generate_cli import resolve_model

    resolve_model("smollm2-135m-instruct")  # fetched now, not under valgrind
    # OpenBLAS preloaded as the other scripts run (its own threads held to one: a count per
    # thread stays a count of the same work); string hashing fixed (dict probes repeat).
    env = dict(preload_env() or os.environ, OPENBLAS_NUM_THREADS="1", PYTHONHASHSEED="0")
    with tempfile.TemporaryDirectory() as tmp, ThreadPoolExecutor(args.jobs) as pool:
        jobs = {(loop, n): pool.submit(run, valgrind, loop, n, Path(tmp), env)
                for loop in LOOPS for n in (short, long)}
        counts = {key: job.result() for key, job in jobs.items()}
    per_token = {}
    for loop in LOOPS:
        a, b = counts[loop, short], counts[loop, long]
        main_thread = (b[1] - a[1]) / (long - short)
        others = (sum(b.values()) - b[1] - (sum(a.values()) - a[1])) / (long - short)
        per_token[loop] = main_thread, others
    base = per_token["mlx-lm stream_generate"]
    print(f"GPU-like regime (30 x 64 llama, 49152 vocabulary), instructions per token "
          f"(callgrind, runs of {long} minus runs of {short} tokens):")
    print(f"{'':26s} {'main thread':>14s} {'ratio':>7s} {'other threads':>15s} {'ratio':>7s}")
    for loop, (m, o) in per_token.items():
        print(f"{loop:26s} {m / 1e6:12.3f} M {m / base[0]:7.4f} {o / 1e6:13.3f} M {o / base[1]:7.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
