"""Shared fixtures: real zoo models (fetched once per machine) and tiny random targets."""

from __future__ import annotations

import os
import sys

import pytest


def pytest_configure(config):
    # On Linux, rerun pytest with OpenBLAS preloaded when it is installed: the real-model
    # tests are ~20x faster than on the reference BLAS that the mlx[cpu] wheel bundles.
    if "mlx" in sys.modules:
        return
    if getattr(config.option, "numprocesses", None) and not os.environ.get("PYTEST_XDIST_WORKER"):
        # pytest-xdist workers (pyproject's addopts: -n 2) already fill the cores: one BLAS
        # thread each, set before they start (OpenBLAS reads it when it loads).
        os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
        config.pluginmanager.register(_RingTestsOnOneWorker())
    from mlx_spec.fastblas import preload_env, restart_with_fast_blas

    if preload_env() is not None:
        # Hand the real stdout/stderr back before the process is replaced.
        config.pluginmanager.getplugin("capturemanager").stop_global_capturing()
        restart_with_fast_blas()


# Tests that start mlx.launch ranks: they share the ring backend's ports (32323 on), so one
# pytest-xdist worker runs all of them, one after another, while the other runs the rest.
RING_FILES = ("test_distributed.py", "test_dist_serve.py")


class _RingTestsOnOneWorker:
    """xdist's loadgroup marks would do this, but pytest 9 ignores the node ids they rename."""

    @pytest.hookimpl
    def pytest_xdist_make_scheduler(self, config, log):
        from xdist.scheduler import LoadScopeScheduling

        class Scheduler(LoadScopeScheduling):  # a work unit per test, the ring tests one unit
            def _split_scope(self, nodeid):
                return "ring" if nodeid.split("::")[0].rsplit("/", 1)[-1] in RING_FILES else nodeid

        return Scheduler(config, log)


@pytest.fixture(autouse=True, scope="session")
def _private_calibration_cache(tmp_path_factory):
    """Calibrations of the tests' tiny random models stay out of the user's cache."""
    from mlx_spec import calibration

    path = tmp_path_factory.mktemp("calibration")
    mp = pytest.MonkeyPatch()
    mp.setattr(calibration, "cache_dir", lambda: path)
    yield path
    mp.undo()


@pytest.fixture(autouse=True)
def _private_policies(tmp_path, monkeypatch):
    """What one test's adaptive policy learns is not a warm start for the next test."""
    from mlx_spec import learned

    monkeypatch.setattr(learned, "policy_dir", lambda: tmp_path / "policies")


@pytest.fixture(scope="session")
def smollm2_path():
    """Folder of the zoo's SmolLM2-135M-Instruct in float32 (downloaded on first use)."""
    from mlx_spec import zoo

    return zoo.fetch("smollm2-135m-instruct", dtype="float32")


@pytest.fixture(scope="session")
def smollm2(smollm2_path):
    """(model, tokenizer) of SmolLM2-135M-Instruct, float32."""
    from mlx_lm import load

    return load(str(smollm2_path))


@pytest.fixture
def untimed_seeded_rows(monkeypatch):
    """Seeded greedy rows choose draft lengths from the calibrated costs and the tokens only, as
    seeded sampled rows do (in a batch, still jointly: a seeded sampled row alone takes its own),
    so a policy rule is tested without timing noise."""
    from mlx_spec.request import Request

    monkeypatch.setattr(Request, "repeatable", property(lambda self: self.seed is not None))


@pytest.fixture(scope="module")
def ngram_server():
    """The tiny llama with an n-gram drafter, k = 4: the server most server tests share."""
    from server_utils import running_server, word_tokenizer
    from test_conversations import drafter_case

    model, make = drafter_case(None, "ngram")
    with running_server(model, word_tokenizer(), make(), num_draft_tokens=4) as s:
        s.model = model
        yield s
