"""The restart with OpenBLAS preloaded (Linux; elsewhere no restart happens)."""

import os
import subprocess
import sys
import sysconfig
import textwrap
from pathlib import Path

import pytest

from mlx_spec import fastblas


def test_when_the_restart_is_wanted(monkeypatch, tmp_path):
    lib = tmp_path / "libblas.so.3"
    lib.write_bytes(b"")
    monkeypatch.setattr(fastblas, "CANDIDATES", (str(tmp_path / "none.so"), str(lib)))
    monkeypatch.setattr(fastblas.platform, "system", lambda: "Linux")
    assert fastblas.preload_env({"LD_PRELOAD": "/x/libother.so"})["LD_PRELOAD"] == f"{lib} /x/libother.so"
    for off in ("1", "yes", "true"):
        assert fastblas.preload_env({"MLX_SPEC_NO_BLAS_PRELOAD": off}) is None
    for unset in ("0", "false", ""):  # ("0" turned it off too)
        assert fastblas.preload_env({"MLX_SPEC_NO_BLAS_PRELOAD": unset}) is not None
    assert fastblas.preload_env({"MLX_SPEC_BLAS_PRELOADED": str(lib)}) is None  # once only
    assert fastblas.preload_env({"LD_PRELOAD": "/opt/intel/libmkl_rt.so"}) is None  # a fast one is there
    monkeypatch.setattr(fastblas.platform, "system", lambda: "Darwin")
    assert fastblas.preload_env({}) is None


def test_the_library_is_this_interpreters_architectures(tmp_path):
    """An i386 copy beside the x86_64 one came first alphabetically; ld.so cannot preload it."""
    arch = sysconfig.get_config_var("MULTIARCH") or ""
    if not arch.endswith("-linux-gnu") or arch.startswith("i386"):
        pytest.skip(f"not a Debian-layout 64-bit Linux interpreter (MULTIARCH {arch!r})")
    for a in ("i386-linux-gnu", arch):
        (tmp_path / "usr/lib" / a / "openblas-pthread").mkdir(parents=True)
        (tmp_path / "usr/lib" / a / "openblas-pthread/libblas.so.3").write_bytes(b"")
    assert fastblas.find_openblas(str(tmp_path)) == str(tmp_path / "usr/lib" / arch / "openblas-pthread/libblas.so.3")


def _restart_env() -> dict:
    if fastblas.preload_env({}) is None:
        pytest.skip("no OpenBLAS installed here (or not Linux): nothing restarts")
    return {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", fastblas._MARK, fastblas._OFF)}


def test_the_restart_keeps_interpreter_options_and_arguments(tmp_path):
    script = tmp_path / "probe.py"
    script.write_text(textwrap.dedent("""
        import os, sys
        from mlx_spec.fastblas import restart_with_fast_blas
        restart_with_fast_blas()
        print(sys.flags.optimize, sys.warnoptions, os.environ.get("MLX_SPEC_BLAS_PRELOADED") is not None, sys.argv[1:])
    """))
    out = subprocess.run([sys.executable, "-O", "-W", "ignore::UserWarning", str(script), "a b", "", "$x"],
                         env=_restart_env(), capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "1 ['ignore::UserWarning'] True ['a b', '', '$x']"


def test_the_mlx_spec_command_restarts_without_importing_the_current_folder(tmp_path):
    """The restart ran `python -m mlx_spec`, which puts the current folder first on sys.path:
    a json.py there was imported instead of the standard library's."""
    command = Path(sys.executable).parent / "mlx-spec"
    if not command.exists():
        pytest.skip("the mlx-spec console script is not installed next to this interpreter")
    (tmp_path / "json.py").write_text("raise SystemExit('imported json.py from the current folder')\n")
    out = subprocess.run([sys.executable, str(command), "--help"], cwd=tmp_path, env=_restart_env(),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "usage: mlx-spec" in out.stdout, out.stderr
