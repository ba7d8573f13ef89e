"""Use a fast BLAS on Linux: restart the process with OpenBLAS preloaded.

The `mlx[cpu]` wheel bundles the reference (netlib) BLAS, about 20x slower for
float32 matmuls than OpenBLAS. MLX calls whichever `cblas_sgemm` the process
resolves first, so preloading an installed OpenBLAS (e.g. Debian's
`libopenblas0-pthread`) speeds everything up without changing results beyond
float rounding. The `mlx-spec` command (and the test suite) re-executes itself
once with `LD_PRELOAD` set when such a library exists and nothing fast is
preloaded yet, with the command line it was started with (interpreter options included).
`MLX_SPEC_NO_BLAS_PRELOAD=1` turns this off.
"""

from __future__ import annotations

import glob
import os
import platform
import sys
import sysconfig

# Debian/Ubuntu (libopenblas0-pthread / -openmp) in this interpreter's own multiarch folder (an
# i386 copy beside it cannot be preloaded), then generic locations.
_ARCH = sysconfig.get_config_var("MULTIARCH") or "*-linux-gnu"
CANDIDATES = (
    f"/usr/lib/{_ARCH}/openblas-pthread/libblas.so.3",
    f"/usr/lib/{_ARCH}/openblas-openmp/libblas.so.3",
    f"/usr/lib/{_ARCH}/libopenblas.so.0",
    "/usr/lib64/libopenblas.so.0",
    "/usr/lib/libopenblas.so.0",
)
_MARK = "MLX_SPEC_BLAS_PRELOADED"
_OFF = "MLX_SPEC_NO_BLAS_PRELOAD"


def find_openblas(root: str = "/") -> str | None:
    for pattern in CANDIDATES:
        hits = sorted(glob.glob(os.path.join(root, pattern.lstrip("/"))))
        if hits:
            return hits[0]
    return None


def preload_env(environ=os.environ) -> dict | None:
    """The environment to restart with, or None when no restart is useful."""
    off = environ.get(_OFF, "").strip().lower() not in ("", "0", "false", "no")
    if platform.system() != "Linux" or off or environ.get(_MARK):
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


def restart_with_fast_blas() -> None:
    """Replace this process by the same command line (`sys.orig_argv`: interpreter options, and
    the console script or `-m` module as it was started, so that the restart imports what the
    first start did) with OpenBLAS preloaded, if useful.

    Returns only when no restart happens. Call before anything imports mlx.
    """
    env = preload_env()
    if env is not None:
        sys.stdout.flush()
        sys.stderr.flush()
        os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)
