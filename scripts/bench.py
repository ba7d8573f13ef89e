#!/usr/bin/env python
"""Run `mlx-spec bench` from a checkout: `python scripts/bench.py [flags]` (see --help).

Like the `mlx-spec` command, it first restarts itself with OpenBLAS preloaded
on Linux when that library is installed (`mlx_spec.fastblas`): MLX's CPU
backend otherwise uses the reference BLAS of the mlx[cpu] wheel, about 20x
slower for float32. MLX_SPEC_NO_BLAS_PRELOAD=1 measures without it.
"""

from __future__ import annotations

import sys

if __name__ == "__main__":
    from mlx_spec.fastblas import restart_with_fast_blas

    restart_with_fast_blas()
    from mlx_spec.cli import main

    sys.exit(main(["bench", *sys.argv[1:]]))
