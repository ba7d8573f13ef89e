"""A rank's watchdog: end this process with a clear error when it stops making progress.

A collective (`all_sum`, `send`/`recv`) blocks inside MLX until every rank takes
part, and MLX's ring backend waits without a limit, also while connecting
(`mx.distributed.init`). A rank whose peer hung (stopped, deadlocked, a sleeping
Mac) or never came up would wait forever. The code that sends messages calls
`beat(where)` as it makes progress (each target forward, each scheduling message
of a sharded server); a thread checks the time since the last beat and, past the
limit, prints which rank gave up where and ends the process with exit code 1
(`os._exit`: the blocked thread cannot be interrupted). `mlx.launch` then stops
the other ranks, and `mlx-spec launch` reports the rank.

`pause()` stops the clock for phases that may legitimately take long without
messages (reading weights from disk); the next `beat` starts it again.

`mx.distributed.init` keeps Python's interpreter lock while it connects, so no
thread of this process can run then: `outside(...)` watches such a call from a
small helper process instead, which ends this one (SIGTERM, then SIGKILL) when
the call has not returned in time.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from contextlib import contextmanager

EXIT_CODE = 1
DEFAULT_TIMEOUT = 300.0  # seconds a rank waits for the others before it gives up (--dist-timeout)


class Watchdog:
    def __init__(self, seconds: float, rank: int | str):
        self.seconds, self.rank = float(seconds), rank
        self.where = "start-up"
        self._last = time.monotonic()
        self._armed = False
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._watch, name="mlx-spec-watchdog", daemon=True)
        self._thread.start()

    def beat(self, where: str | None = None) -> None:
        with self._lock:
            self._last, self._armed = time.monotonic(), True
            if where is not None:
                self.where = where

    def pause(self) -> None:
        with self._lock:
            self._armed = False

    def _watch(self) -> None:
        tick = min(1.0, max(self.seconds / 10, 0.05))
        while True:
            time.sleep(tick)
            with self._lock:
                late = self._armed and time.monotonic() - self._last > self.seconds
                where = self.where
            if late:
                self.expire(where)

    def expire(self, where: str) -> None:
        sys.stderr.write(message(self.rank, self.seconds, where))
        sys.stderr.flush()
        os._exit(EXIT_CODE)


def message(rank, seconds: float, where: str) -> str:
    return (f"\nerror: rank {rank} made no progress for {seconds:g} s at {where}: another rank "
            "hung, died or cannot be reached; ending this rank (limit: --dist-timeout)\n")


# The helper: waits on its stdin (closed by this process when the call returned, or when this
# process ended) for at most the limit; otherwise prints the message and ends this process.
_HELPER = """
import os, select, signal, sys, time
pid, seconds, text = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
ready, _, _ = select.select([sys.stdin], [], [], seconds)
if not ready:
    sys.stderr.write(text)
    sys.stderr.flush()
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            break
        time.sleep(2)
"""


@contextmanager
def outside(seconds: float | None, rank, where: str):
    """Watch the block from another process (for calls that hold the interpreter lock)."""
    if not seconds:
        yield
        return
    helper = subprocess.Popen([sys.executable, "-c", _HELPER, str(os.getpid()), str(seconds),
                               message(rank, seconds, where)], stdin=subprocess.PIPE)
    try:
        yield
    finally:
        helper.stdin.close()
        helper.wait()


_CURRENT: Watchdog | None = None


def watch(seconds: float | None, rank: int | str) -> Watchdog | None:
    """Start this process's watchdog (None or 0 seconds: none). Returns it."""
    global _CURRENT
    if not seconds:
        return None
    if _CURRENT is None:
        _CURRENT = Watchdog(seconds, rank)
    else:
        _CURRENT.seconds, _CURRENT.rank = float(seconds), rank
    return _CURRENT


def beat(where: str | None = None) -> None:
    if _CURRENT is not None:
        _CURRENT.beat(where)


def pause() -> None:
    if _CURRENT is not None:
        _CURRENT.pause()
