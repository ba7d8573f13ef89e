"""What machine a benchmark ran on: chip or CPU, memory, MLX version and device, BLAS.

Speed-ups only mean something next to the hardware that produced them. On
Linux, MLX's CPU backend calls whatever BLAS the process has loaded: the
`mlx[cpu]` wheel bundles the reference (netlib) BLAS, about 20x slower for
float32 matmuls than OpenBLAS preloaded with LD_PRELOAD, so the report names
the library it finds in /proc/self/maps and warns when it is the slow one.
"""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path

OPENBLAS_HINT = (
    "LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 "
    "(Debian/Ubuntu: apt-get install libopenblas0-pthread)"
)
# Fast BLAS implementations, by a substring of their file name.
_FAST = {"openblas": "OpenBLAS", "mkl": "Intel MKL", "blis": "BLIS", "armpl": "Arm PL"}


def detect_blas(maps_text: str) -> dict:
    """Classify the BLAS loaded in a process from the text of its /proc/<pid>/maps.

    Returns {"name", "paths", "slow"}; "slow" is True for the reference BLAS.
    numpy's private OpenBLAS (`libscipy_openblas*`, symbols renamed) is ignored:
    MLX cannot call it.
    """
    paths = []
    for line in maps_text.splitlines():
        parts = line.split()
        if len(parts) < 6 or not parts[-1].startswith("/"):
            continue
        path = parts[-1]
        lib = path.lower()
        base = os.path.basename(lib)
        if "scipy_openblas" in base or not ("blas" in base or "mkl" in base):
            continue
        if path not in paths:
            paths.append(path)
    for path in paths:
        low = path.lower()  # the directory counts: .../openblas-pthread/libblas.so.3
        for key, name in _FAST.items():
            if key in low:
                return {"name": name, "paths": paths, "slow": False}
    if paths:
        return {"name": "reference BLAS (netlib)", "paths": paths, "slow": True}
    return {"name": "none found", "paths": [], "slow": False}


def _read(path: str) -> str:
    try:
        return Path(path).read_text(errors="replace")
    except OSError:
        return ""


def _sysctl(key: str) -> str:
    try:
        out = subprocess.run(["sysctl", "-n", key], capture_output=True, text=True, timeout=5)
        return out.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def _cpu_name() -> str:
    if platform.system() == "Darwin":
        return _sysctl("machdep.cpu.brand_string") or platform.processor()
    for line in _read("/proc/cpuinfo").splitlines():
        if line.lower().startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def _memory_gb() -> float | None:
    if platform.system() == "Darwin":
        value = _sysctl("hw.memsize")
        return round(int(value) / 2**30, 1) if value.isdigit() else None
    for line in _read("/proc/meminfo").splitlines():
        if line.startswith("MemTotal:"):
            return round(int(line.split()[1]) / 2**20, 1)  # kB -> GiB
    return None


def hardware_info() -> dict:
    """Everything the report says about the machine; import mlx only here."""
    import mlx.core as mx

    info = {
        "platform": f"{platform.system()} {platform.machine()}",
        "cpu": _cpu_name(),
        "cpu_count": os.cpu_count(),
        "memory_gb": _memory_gb(),
        "python": platform.python_version(),
        "mlx_version": mx.__version__,
        "mlx_device": str(mx.default_device()),
        "gpu": None,
        "blas": None,
        "warnings": [],
    }
    try:
        import mlx_lm

        info["mlx_lm_version"] = mlx_lm.__version__
    except (ImportError, AttributeError):
        info["mlx_lm_version"] = None
    if mx.metal.is_available():
        dev = mx.metal.device_info()
        info["gpu"] = dev.get("device_name") or dev.get("architecture")
    if platform.system() == "Linux":
        info["blas"] = detect_blas(_read("/proc/self/maps"))
        if info["blas"]["slow"] and "cpu" in info["mlx_device"]:
            info["warnings"].append(
                "MLX runs on the CPU with the reference BLAS bundled in the mlx[cpu] wheel, "
                "about 20x slower for float32 matmuls than OpenBLAS: numbers are not "
                f"representative. Preload OpenBLAS: {OPENBLAS_HINT}"
            )
    elif platform.system() == "Darwin":
        info["blas"] = {"name": "Accelerate", "paths": [], "slow": False}
    return info


def load_average() -> float | None:
    """The 1-minute load average (None where the OS has none)."""
    try:
        return os.getloadavg()[0]
    except (OSError, AttributeError):
        return None


def busy_warning(loads: list[float | None], cores: int | None) -> str | None:
    """A warning when other work competed for the cores while the benchmark ran."""
    worst = max((x for x in loads if x is not None), default=None)
    # The benchmark itself keeps about `cores` threads busy (BLAS threads plus the main one).
    if worst is None or not cores or worst <= 1.5 * cores + 0.5:
        return None
    return (f"the machine was busy (load average up to {worst:.1f} on {cores} cores; this "
            f"benchmark alone accounts for about {cores}): other processes took CPU time, so "
            "tokens/s are low and noisy; acceptance, tau and the identical-output check are not")


def describe(info: dict) -> str:
    """One line for the report header."""
    mem = f"{info['memory_gb']} GB" if info.get("memory_gb") else "? GB"
    chip = info.get("gpu") or info["cpu"]
    blas = (info.get("blas") or {}).get("name", "?")
    return (
        f"{chip} ({info['cpu_count']} cores, {mem}), {info['platform']}, MLX {info['mlx_version']} "
        f"on {info['mlx_device']}, mlx-lm {info.get('mlx_lm_version')}, BLAS: {blas}"
    )
