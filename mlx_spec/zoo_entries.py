"""The zoo cache's entries on disk: one fetch at a time, work folders, installs, leftovers.

An entry `<cache>/models/<name>-<dtype>/` is only ever replaced by a rename. Beside it:
`.<entry>.lock` (held while fetching), `.<entry>.partial-<host>-<pid>-<token>` (a fetch's work
folder) and `.<entry>.stale-<time>-<token>` (a copy that a rename replaced). What a killed fetch
left, and replaced copies once nobody can still be opening them, the next fetch removes.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import socket
import time
from pathlib import Path
from typing import Callable

# A copy replaced by `--force` is renamed aside, not deleted at once: another process may have
# been handed its path a moment before and still be opening its files. A later fetch removes it.
STALE_GRACE_S = 600


@contextlib.contextmanager
def exclusive(final: Path, log):
    """Hold the entry's lock file (`.<entry>.lock` beside it) while inside."""
    try:
        import fcntl
    except ImportError:  # no flock here: fetches of one entry are not serialised
        yield
        return
    with open(final.parent / f".{final.name}.lock", "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log(f"waiting for another process fetching {final.name}")
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def work_folder(final: Path) -> Path:
    """A new hidden sibling of `final` to build it in (same filesystem: the last step is a
    rename), named after this process so that a later fetch can tell when it was killed."""
    work = final.parent / f".{final.name}.partial-{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}"
    work.mkdir()
    return work


def sweep(final: Path, log) -> None:
    """Remove what earlier fetches of `final` left beside it: work folders of processes of this
    host that no longer run (a running fetch's is kept), and replaced copies once no reader can
    still be opening them (`STALE_GRACE_S` after the replacement; at once if killed mid-way)."""
    host, now = socket.gethostname(), time.time()
    for leftover in final.parent.glob(f".{final.name}.*-*"):
        kind, _, rest = leftover.name[len(final.name) + 2:].partition("-")
        if kind == "partial":
            owner, _, _token = rest.rpartition("-")
            at, _, pid = owner.rpartition("-")
            if at != host or not pid.isdigit() or _running(int(pid)):
                continue  # another machine's (a shared cache), or a fetch still under way
            log(f"removing {leftover.name}, left by an interrupted fetch")
        elif kind == "stale":
            when, _, _token = rest.rpartition("-")
            if when.isdigit() and now - int(when) < STALE_GRACE_S:
                continue  # replaced moments ago: a reader may still be opening its files
        else:
            continue
        shutil.rmtree(leftover, ignore_errors=True)


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # exists, owned by someone else
        return True
    return True


def install(out: Path, final: Path, complete: Callable[[Path], bool], replace: bool = False) -> None:
    """Rename `out` to `final`, replacing a `final` that is not `complete` (any, if `replace`).

    The replaced copy is renamed aside; a complete one (a `--force` of a working entry) stays
    there for `STALE_GRACE_S`, so that a process that had just been handed `final` can still
    read it, and a later fetch removes it; an incomplete one nobody can use goes at once."""
    if final.exists():
        usable = complete(final)
        if usable and not replace:  # another process finished first
            return
        stale = final.parent / f".{final.name}.stale-{int(time.time())}-{secrets.token_hex(4)}"
        final.rename(stale)
        if not usable:
            shutil.rmtree(stale, ignore_errors=True)
    try:
        out.rename(final)
    except OSError:
        if not complete(final):  # lost a race to a finished copy: fine; else report
            raise
