"""Use a fast BLAS on Linux: restart the process with OpenBLAS preloaded.

The `mlx[cpu]` wheel bundles the reference (netlib) BLAS, about 20x slower for
float32 matmuls than OpenBLAS. MLX calls whichever `cblas_sgemm` the process
resolves first, so preloading an installed OpenBLAS (e.g. Debian's
`libopenblas0-pthread`) speeds everything up without changing results beyond
float rounding. The `mlx-spec` command (and the test suite) re-executes itself
once with `LD_PRELOAD` set when such a library exists and nothing fast is
preloaded yet. `MLX_SPEC_NO_BLAS_PRELOAD=1` turns this off.
"""

from __future__ import annotations

import glob
import os
import platform
import sys

# Debian/Ubuntu (libopenblas0-pthread / -openmp), then generic locations.
CANDIDATES = (
    "/usr/lib/*-linux-gnu/openblas-pthread/libblas.so.3",
    "/usr/lib/*-linux-gnu/openblas-openmp/libblas.so.3",
    "/usr/lib/*-linux-gnu/libopenblas.so.0",
    "/usr/lib64/libopenblas.so.0",
    "/usr/lib/libopenblas.so.0",
)
_MARK = "MLX_SPEC_BLAS_PRELOADED"


def find_openblas() -> str | None:
    for pattern in CANDIDATES:
        hits = sorted(glob.glob(pattern))
        if hits:
            return hits[0]
    return None


def preload_env(environ=os.environ) -> dict | None:
    """The environment to restart with, or None when no restart is useful."""
    if platform.system() != "Linux" or environ.get("MLX_SPEC_NO_BLAS_PRELOAD") or environ.get(_MARK):
        return None
    preload = environ.get("LD_PRELOAD", "")
    if any(k in preload.lower() for k in ("blas", "mkl", "blis")):
        return None
    lib = find_openblas()
    if lib is None:
        return None
    env = dict(environ)
    env["LD_PRELOAD"] = f"{lib} {preload}".strip()
    env[_MARK] = lib
    return env


def restart_with_fast_blas(python_args: list[str]) -> None:
    """Replace this process by `python <python_args>` with OpenBLAS preloaded, if useful.

    Returns only when no restart happens. Call before anything imports mlx.
    """
    env = preload_env()
    if env is not None:
        sys.stdout.flush()
        sys.stderr.flush()
        os.execve(sys.executable, [sys.executable, *python_args], env)
