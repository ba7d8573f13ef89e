"""Broken model and head folders: one `error:` line naming the file and the fix, no traceback.

Each case breaks a copy of a tiny model folder (or head folder) the way a user's can break
(an interrupted download, a hand-edited config, a deleted file) and runs the real command,
`python -m mlx_spec generate`, in a subprocess; the Python API raises ModelLoadError.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest

import mlx_spec
import tiny
from eagle_fixtures import eagle1_checkpoint
from mlx_spec import zoo
from mlx_spec.load_errors import ModelLoadError, safetensors_problem


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> dict[str, Path]:
    """A loadable tiny target (weights, config, tokenizer) and an EAGLE head converted for it."""
    from converters.eagle import v1

    root = tmp_path_factory.mktemp("good")
    target = tiny.model_folder(root / "target")
    eagle1_checkpoint(root / "eagle-src", 64, tiny.VOCAB, fmt="safetensors")
    head = v1.convert(root / "eagle-src", root / "head", target)
    return {"target": target, "head": head}


def _copy(folder: Path, dest: Path) -> Path:
    shutil.copytree(folder, dest)
    return dest


def _truncate(path: Path, keep: int = 200) -> None:
    data = path.read_bytes()
    path.write_bytes(data[:keep])


def _drop_tensor(path: Path) -> None:
    weights = mx.load(str(path))
    weights.pop(sorted(weights)[-1])
    mx.save_safetensors(str(path), weights)


def _generate(*args: str, env: dict | None = None, cwd: Path) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "mlx_spec", "generate", "--prompt", "w3 w4", "--max-tokens", "2", *args]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=cwd, timeout=300,
                          env={**os.environ, **(env or {})})


def _one_error_line(run: subprocess.CompletedProcess) -> str:
    assert run.returncode == 2, run.stderr
    assert "Traceback" not in run.stderr
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), run.stderr
    return lines[0]


# how to break a copy of the target -> (the file the message must name, words it must hold)
TARGET_CASES = {
    "truncated weights": (lambda d: _truncate(d / "model.safetensors"), "model.safetensors", "truncated"),
    "invalid config.json": (lambda d: (d / "config.json").write_text('{\n\n  "model_type": '),
                            "config.json", "not valid JSON"),
    "no tokenizer.json": (lambda d: (d / "tokenizer.json").unlink(), "tokenizer.json", "missing"),
    "no weights": (lambda d: (d / "model.safetensors").unlink(), "model.safetensors", "missing"),
    "a tensor dropped": (lambda d: _drop_tensor(d / "model.safetensors"), "model.safetensors",
                         "does not fit config.json (Missing 1 parameters"),
}


@pytest.mark.parametrize("case", TARGET_CASES)
def test_a_broken_target_folder_is_one_line_naming_the_file_and_the_fix(case, good, tmp_path):
    breaks, name, words = TARGET_CASES[case]
    folder = _copy(good["target"], tmp_path / "model")
    breaks(folder)
    line = _one_error_line(_generate("--model", str(folder), cwd=tmp_path))
    assert f"{folder / name} " in line and words in line
    assert f"`hf download ORG/NAME --local-dir {folder}`" in line  # a plain folder: replace it


def test_a_broken_draft_model_names_the_draft_s_file(good, tmp_path):
    draft = _copy(good["target"], tmp_path / "draft")
    (draft / "config.json").write_text("{")
    line = _one_error_line(_generate("--model", str(good["target"]), "--draft-model", str(draft),
                                     cwd=tmp_path))
    assert f"{draft / 'config.json'} is not valid JSON" in line


@pytest.mark.parametrize("damage", ["truncated weights", "invalid config.json"])
def test_a_broken_head_folder_says_convert_it_again(damage, good, tmp_path):
    head = _copy(good["head"], tmp_path / "head")
    if damage == "truncated weights":
        _truncate(head / "model.safetensors", 5000)
        bad = head / "model.safetensors"
    else:
        (head / "config.json").write_text("{'mlx_spec': 1}")
        bad = head / "config.json"
    line = _one_error_line(_generate("--model", str(good["target"]), "--draft", str(head), cwd=tmp_path))
    assert f"{bad} " in line
    assert f"`mlx-spec convert head SRC {head} --target TARGET --force`" in line


def test_a_damaged_zoo_entry_says_fetch_model_force(good, tmp_path):
    # A same-size edit passes the zoo's size check, so the cached folder is loaded as is.
    spec = zoo.MODELS[generate_default := "smollm2-135m-instruct"]
    entry = _copy(good["target"], tmp_path / "cache" / "models" / f"{generate_default}-float32")
    config = (entry / "config.json").read_text()
    (entry / "config.json").write_text(config.replace('"llama"', '"llam@"'))
    zoo._write_marker(entry, spec, "float32")
    assert zoo.is_complete(entry, spec)
    line = _one_error_line(_generate(env={"MLX_SPEC_CACHE": str(tmp_path / "cache")}, cwd=tmp_path))
    assert f"{entry / 'config.json'} names model_type 'llam@'" in line
    assert line.endswith("fetch it again: `mlx-spec fetch-model smollm2-135m-instruct --force`")


def test_verbose_adds_the_traceback(good, tmp_path):
    folder = _copy(good["target"], tmp_path / "model")
    _truncate(folder / "model.safetensors")
    run = _generate("--model", str(folder), "--verbose", cwd=tmp_path)
    assert run.returncode == 2 and "Traceback" in run.stderr
    assert run.stderr.strip().splitlines()[-1].startswith(f"error: {folder / 'model.safetensors'} ")


@pytest.mark.download
def test_a_truncated_copy_of_the_real_smollm2_folder(smollm2_path, tmp_path):
    folder = tmp_path / "smollm2"
    folder.mkdir()
    for f in smollm2_path.iterdir():
        if f.name not in ("model.safetensors", zoo.MARKER):
            (folder / f.name).symlink_to(f)
    with open(smollm2_path / "model.safetensors", "rb") as f:
        (folder / "model.safetensors").write_bytes(f.read(1_000_000))
    line = _one_error_line(_generate("--model", str(folder), cwd=tmp_path))
    assert f"{folder / 'model.safetensors'} is truncated (1,000,000 of 538,090,241 bytes)" in line


# --- the Python API ---


def test_load_raises_model_load_error_which_old_handlers_still_catch(good, tmp_path):
    folder = _copy(good["target"], tmp_path / "model")
    _truncate(folder / "model.safetensors")
    with pytest.raises(ModelLoadError) as info:
        mlx_spec.load(str(folder))
    with pytest.raises(ModelLoadError):
        mlx_spec.load(folder)  # a Path too (not an AttributeError)
    e = info.value
    assert isinstance(e, ValueError) and isinstance(e, OSError) and mlx_spec.ModelLoadError is ModelLoadError
    assert e.path == folder / "model.safetensors" and "hf download" in e.fix and "\n" not in str(e)
    assert isinstance(e.__cause__, RuntimeError)  # mlx's own error stays attached

    (folder / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="config.json is missing"):
        mlx_spec.load(str(folder))
    with pytest.raises(FileNotFoundError, match="neither a folder nor a Hugging Face repo id"):
        mlx_spec.load(str(tmp_path / "nowhere"))
    with pytest.raises(FileNotFoundError, match="a zoo name: smollm2-135m-instruct, "):  # a typo'd name
        mlx_spec.load("smollm2")


def test_head_errors_that_are_not_about_files_pass_through_unchanged(good, tmp_path):
    other = tiny.llama_model(layers=3)
    with pytest.raises(ValueError, match="converted for another target") as info:
        mlx_spec.load_drafter(good["head"], other)
    assert not isinstance(info.value, ModelLoadError)
    head = _copy(good["head"], tmp_path / "head")
    (head / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="model.safetensors is missing.*mlx-spec convert head"):
        mlx_spec.load_drafter(head, tiny.llama_model(layers=2))


def test_safetensors_framing_check(good, tmp_path):
    path = good["target"] / "model.safetensors"
    assert safetensors_problem(path) is None
    copy = tmp_path / "w.safetensors"
    copy.write_bytes(path.read_bytes()[:-1])
    assert safetensors_problem(copy) == (
        f"is truncated ({path.stat().st_size - 1:,} of {path.stat().st_size:,} bytes)")
    copy.write_bytes(b"\xff" * 64)
    assert "damaged or truncated" in safetensors_problem(copy)


def test_the_fix_follows_where_the_folder_came_from(good, tmp_path):
    from mlx_spec.load_errors import fix_for

    hub = _copy(good["target"], tmp_path / "hub" / "models--org--name" / "snapshots" / "abc123")
    assert fix_for(hub) == "download it again: `hf download org/name --force-download`"
    gguf = _copy(good["target"], tmp_path / "from-gguf")
    (gguf / "model.Q4_K_M.gguf").write_bytes(b"GGUF")
    assert f"`mlx-spec convert gguf {gguf / 'model.Q4_K_M.gguf'} OUT_DIR`" in fix_for(gguf)
    assert "mlx-spec convert head" in fix_for(good["head"])
    entry = _copy(good["target"], tmp_path / "cache" / "models" / "gemma-3-270m-bfloat16")
    zoo._write_marker(entry, zoo.MODELS["gemma-3-270m"], "bfloat16")
    assert fix_for(entry) == (f"fetch it again: `mlx-spec fetch-model gemma-3-270m --force "
                              f"--dtype bfloat16 --cache-dir {tmp_path / 'cache'}`")


def test_a_plain_model_given_as_a_head_points_at_draft_model(tmp_path):
    """A small model of the target's family given as --draft (a head) is the commonest mix-up;
    --draft mtp on a model without MTP weights says so rather than asking for a conversion."""
    import tiny

    folder = tiny.model_folder(tmp_path / "small", layers=1)
    model = tiny.llama_model()
    with pytest.raises(ValueError, match=r"drafts as a draft model \(--draft-model"):
        mlx_spec.load_drafter(folder, model)
    with pytest.raises(ValueError, match=r"carries no mtp weights \(model type 'llama'\): use another drafter"):
        mlx_spec.load_drafter(folder, model, kind="mtp")
