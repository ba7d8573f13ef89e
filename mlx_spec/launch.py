"""`mlx-spec launch`: run an mlx-spec command on several ranks through `mlx.launch`.

    mlx-spec launch -n 2 --backend ring -- generate --shard pipeline --prompt "..."

starts `mlx.launch` with this Python running `-m mlx_spec generate ...` on every
rank (two local ranks here; `--hosts`/`--hostfile` for several Macs, where the
same Python path and mlx-spec must exist on each). `mlx.launch` ends the other
ranks when one fails but exits 0 even then (MLX 0.32.4); this command reads
its per-rank exit notes and exits 1 naming the rank. When a rank has failed and
the others are still there `GRACE` seconds later (a stopped process does not
take mlx.launch's SIGTERM), it ends every process it started (their process
group), as it does with `--timeout` when the time is up.
"""

from __future__ import annotations

import argparse
import io
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time

RUNNABLE = ("generate", "bench", "serve")  # commands that know --shard
GRACE = 10.0  # seconds the other ranks get to end after one failed
MAX_ARG = 100_000  # bytes of one command-line argument (Linux refuses one over 128 KiB)
FAILED = re.compile(r"Node with rank (\d+) exited with code (-?\d+)")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("-n", "--repeat-hosts", type=int, default=None,
                   help="processes per host (mlx.launch -n); alone: that many local ranks")
    p.add_argument("--hosts", default=None, help="comma-separated hosts (mlx.launch --hosts)")
    p.add_argument("--hostfile", default=None, help="hosts file (mlx.launch --hostfile)")
    p.add_argument("--backend", default="ring", help="ring (default), jaccl, mpi (mlx.launch --backend)")
    p.add_argument("--starting-port", type=int, default=None, help="first ring port (mlx.launch -p)")
    p.add_argument("--timeout", type=float, default=None,
                   help="seconds after which every rank is stopped (default: no limit)")
    p.add_argument("--dry-run", action="store_true", help="print the mlx.launch command and exit")
    p.add_argument("command", nargs=argparse.REMAINDER,
                   help="-- then the mlx-spec command every rank runs, e.g. -- generate --shard pipeline")


def launch_command(args: argparse.Namespace) -> list[str]:
    command = list(args.command)
    if command[:1] == ["--"]:
        command = command[1:]
    if not command or command[0] not in RUNNABLE:
        raise ValueError(f"give the command after --, one of: {', '.join(RUNNABLE)} "
                         f"(got {' '.join(command) or 'nothing'})")
    if not any(a == "--shard" or a.startswith("--shard=") for a in command):
        raise ValueError("the ranks' command needs --shard pipeline or --shard tensor")
    tool = shutil.which("mlx.launch") or os.path.join(os.path.dirname(sys.executable), "mlx.launch")
    out = [tool, "--backend", args.backend]
    for flag, value in (("-n", args.repeat_hosts), ("--hosts", args.hosts),
                        ("--hostfile", args.hostfile), ("--starting-port", args.starting_port)):
        if value is not None:
            out += [flag, str(value)]
    if args.hosts or args.hostfile:
        out += ["--python", sys.executable]
    # "--": mlx.launch must not read the ranks' own options (--verbose, --env, ...)
    return out + ["--", sys.executable, "-m", "mlx_spec", *command]


def run(args: argparse.Namespace) -> int:
    try:
        command = launch_command(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.dry_run:
        print(" ".join(command))
        return 0
    try:
        args.command = _read_stdin_prompt(args.command)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    command = launch_command(args)
    # The ranks run in a session of their own (so that they can be stopped as one group): when
    # this process is told to end (Ctrl-C, SIGTERM, a closed terminal) it ends them first.
    ending, proc = _raise_on((signal.SIGTERM, signal.SIGHUP)), None
    failed: list[tuple[int, int]] = []
    try:
        proc = subprocess.Popen(command, stdin=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)
        quiet_stdin(proc)
        reader = threading.Thread(target=_relay, args=(proc.stderr, failed), daemon=True)
        reader.start()
        rc = _wait(proc, args.timeout, failed)
        if rc is None:
            print(f"error: the ranks did not finish within {args.timeout:g} s; stopped all of them "
                  "(a rank that cannot connect or a lost peer can block the others)", file=sys.stderr)
            return 124
    except BaseException:
        if proc is not None:
            stop(proc)
        raise
    finally:
        ending()
    reader.join(timeout=5)
    bad = [(r, c) for r, c in failed if c != 0]
    if bad:
        rank, code = bad[0]
        if rank is None:
            print("error: mlx.launch could not start the ranks (its traceback is above)", file=sys.stderr)
            return 1
        how = f"signal {-code}" if code < 0 else f"exit code {code}"
        others = f"; {len(bad) - 1} other rank(s) ended too" if len(bad) > 1 else ""
        print(f"error: rank {rank} ended with {how}{others}", file=sys.stderr)
        return 1
    return rc


def _read_stdin_prompt(command: list[str]) -> list[str]:
    """generate's `--prompt -` read here, once, and given to every rank as it is (the ranks'
    stdin is a pipe nobody writes to: they would wait on it for good)."""
    out = list(command)
    if "generate" not in out[:2]:  # (after an optional --)
        return out
    for i in range(len(out)):
        joined = out[i] in ("--prompt=-", "-p=-", "-p-")
        if joined or (out[i] in ("--prompt", "-p") and out[i + 1:i + 2] == ["-"]):
            text = sys.stdin.read()
            if not text.strip():
                raise ValueError("the prompt is empty (nothing came on stdin): give some text")
            # mlx.launch hands each rank a shell command holding it quoted (each ' takes 5 bytes)
            size = len(shlex.quote(text).encode())
            if size > MAX_ARG:
                raise ValueError(f"the prompt read from stdin takes {size:,} bytes quoted; the ranks get it on "
                                 f"their command line, which takes at most {MAX_ARG:,}: pass a shorter prompt")
            out[i:i + (1 if joined else 2)] = [f"--prompt-verbatim={text}"]  # (= : text may start with -)
            break
    return out


def _raise_on(signals) -> callable:
    """Turn `signals` into SystemExit(128 + signal) in this (main) thread; returns the undo."""
    def handler(signum, frame):
        raise SystemExit(128 + signum)

    try:
        before = {sig: signal.signal(sig, handler) for sig in signals}
    except ValueError:  # not the main thread: leave the handlers alone
        return lambda: None
    return lambda: [signal.signal(sig, old) for sig, old in before.items()]


STDIN_FILL = 1 << 20  # bytes: more than a pipe to a rank holds


def quiet_stdin(proc: subprocess.Popen) -> None:
    """Keep mlx.launch `proc` (started with stdin=PIPE) from spinning. Its thread for each rank
    waits in select() for the rank's stdin to become writable, and a pipe nobody reads always is,
    so each thread spins (2 ranks sleeping 6 s cost 8 CPU-seconds, half of it in the kernel; on
    2 cores the ranks lose one). A full pipe is not writable: mlx.launch's stdin gets more than
    a rank's pipe holds (the ranks never read it: a prompt from stdin reaches them as an
    argument) and stays open (at end of file its own loop spins too) while `proc` lives."""
    pipe, proc.stdin = proc.stdin, None  # (communicate() would close it)
    proc._quiet_stdin = pipe
    fill = "\n" * STDIN_FILL if isinstance(pipe, io.TextIOBase) else b"\n" * STDIN_FILL

    def feed() -> None:
        try:
            pipe.write(fill)
            pipe.flush()
        except (OSError, ValueError):  # mlx.launch ended (or could not start)
            pass

    threading.Thread(target=feed, daemon=True).start()


def _wait(proc: subprocess.Popen, timeout: float | None, failed: list) -> int | None:
    """mlx.launch's exit code; None when `timeout` ran out (every rank stopped then). Once a
    rank has failed, the others get `GRACE` seconds to end before they are stopped."""
    end = None if timeout is None else time.monotonic() + timeout
    grace = None
    while True:
        try:
            return proc.wait(timeout=0.5)
        except subprocess.TimeoutExpired:
            pass
        now = time.monotonic()
        if grace is None and any(code != 0 for _, code in failed):
            grace = now + GRACE
        if grace is not None and now > grace:
            print(f"mlx-spec launch: ranks still running {GRACE:g} s after one failed; "
                  "stopping them", file=sys.stderr)
            stop(proc)
            return proc.returncode if proc.returncode is not None else 1
        if end is not None and now > end:
            stop(proc)
            return None


def _relay(stream, failed: list) -> None:
    for line in stream:
        sys.stderr.write(line)
        for m in FAILED.finditer(line):  # (two ranks' notes can share a line)
            failed.append((int(m.group(1)), int(m.group(2))))
        if line.startswith("Exception in thread"):  # mlx.launch could not start a rank (it exits 0)
            failed.append((None, 1))


def stop(proc: subprocess.Popen) -> None:
    """End mlx.launch and every rank it started (one process group): SIGTERM, then SIGKILL
    for whatever is left in the group (a stopped rank keeps a SIGTERM pending)."""
    for sig, wait in ((signal.SIGTERM, 5), (signal.SIGKILL, 5)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            continue
