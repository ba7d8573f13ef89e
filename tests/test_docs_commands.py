"""Every command the docs and the CLI's messages tell a user to run exists here, with its flags.

Commands come from README.md and docs/*.md (shell blocks and inline code) and from the
backticked spans of mlx_spec/ and converters/ (error messages, help, docstrings) and of
the bench's claims.json. For each
`hf ...`, `mlx-spec ...`, `mlx_lm.<tool> ...`, `python scripts/...` and `pip install ...`
the program or subcommand must exist in this environment and accept every flag used.
Offline: only `--help` is run.
"""

from __future__ import annotations

import argparse
import importlib
import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from functools import cache
from pathlib import Path

import pytest

from mlx_spec import cli

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
CODE = sorted(p for d in ("mlx_spec", "converters") for p in (ROOT / d).rglob("*.py"))
CODE.append(ROOT / "mlx_spec" / "bench" / "data" / "claims.json")
PROGRAM = re.compile(r"(?:^|(?<=[\s(;]))(hf|huggingface-cli|mlx-spec|mlx_lm\.\w+|pip3? install|python3? scripts/\S+|"
                     r"python3? -m mlx_spec)(?=\s|$)")


def _segments(text: str) -> list[str]:
    """Shell text cut into simple commands: comments dropped, continuations joined, split at
    `&&`, `;`, `$(` and pipes (a `|` inside [..] or (..) is a usage alternative, kept)."""
    lines = [re.sub(r"(^|\s)#.*", "", line) for line in text.replace("\\|", "|").splitlines()]
    text = re.sub(r"\\\s*\n", " ", "\n".join(lines)).replace("$(", ";")
    out, depth, cur = [], 0, ""
    for i, ch in enumerate(text):
        depth += ch in "[(" and text[i - 1 : i] != "$"
        depth -= ch in "])" and depth > 0
        if depth == 0 and (ch in ";\n" or (ch == "|" and text[i + 1 : i + 2] != "|")
                           or text[i : i + 2] == "&&"):
            out.append(cur)
            cur = ""
        elif not (ch == "&" and text[i - 1 : i] == "&"):
            cur += ch
    return [" ".join(s.split()) for s in out + [cur] if s.strip()]


def commands(text: str, markdown: bool) -> list[str]:
    """The commands `text` names, each starting at its program."""
    if markdown:
        fenced = re.findall(r"```[a-z]*\n(.*?)```", text, re.S)
        prose = re.sub(r"```.*?```", "", text, flags=re.S)
        pieces = fenced + re.findall(r"`([^`\n]+)`", prose)
    else:
        pieces = re.findall(r"`([^`\n]+)`", text)
    found = []
    for piece in pieces:
        for seg in _segments(piece):
            m = PROGRAM.search(seg)
            # `mlx_lm.load` alone is a Python function, `mlx_lm.convert --hf-path ...` a command
            if m and (" " in seg[m.start():] or not m.group(1).startswith("mlx_lm.")):
                found.append(seg[m.start():].rstrip("`,;"))
    return found


def all_commands() -> list[tuple[str, str]]:
    named = [(p, c) for p in DOCS for c in commands(p.read_text(), markdown=True)]
    named += [(p, c) for p in CODE for c in commands(p.read_text(), markdown=False)]
    return [(str(p.relative_to(ROOT)), c) for p, c in named]


def _words(cmd: str) -> list[str]:
    try:
        words = shlex.split(cmd)
    except ValueError:  # an apostrophe in a placeholder, e.g. <Meta's repo>
        words = cmd.split()
    return words


def _flags(words: list[str]) -> set[str]:
    words = [w.strip("[]()") for w in words]  # a usage line's [--flag VALUE]
    return {w.split("=")[0] for w in words if re.fullmatch(r"--?[A-Za-z][\w-]*(=.*)?", w)}


@cache
def _help(*argv: str) -> str:
    env = {**os.environ, "MLX_SPEC_NO_BLAS_PRELOAD": "1"}
    run = subprocess.run([*argv, "--help"], capture_output=True, text=True, cwd=ROOT, env=env,
                         timeout=120)
    assert run.returncode == 0, f"{' '.join(argv)} --help failed: {run.stderr[-500:]}"
    return run.stdout


def _mlx_spec_parser(words: list[str]) -> argparse.ArgumentParser:
    """The parser of the `mlx-spec` subcommand `words` starts with."""
    sub = words[0] if words else None
    if sub == "convert":
        kind = words[1] if len(words) > 1 else None
        assert kind in cli.CONVERTERS, f"mlx-spec convert has no kind {kind!r}"
        module = cli.CONVERTERS[kind][0]
    else:
        assert sub in cli.COMMANDS, f"mlx-spec has no command {sub!r}"
        module = cli.COMMANDS[sub][0]
    parser = argparse.ArgumentParser(add_help=True)
    importlib.import_module(module).add_arguments(parser)
    # A command with jobs of its own (`mlx-spec train eagle3`): the job's parser.
    jobs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if jobs:
        at = 2 if sub == "convert" else 1
        if len(words) <= at or words[at].startswith("-"):
            return parser  # the command named alone
        assert words[at] in jobs[0].choices, f"mlx-spec {sub} has no job {words[at]!r}"
        return jobs[0].choices[words[at]]
    return parser


def _check_names(words: list[str]) -> None:
    """A zoo model or bench preset named literally (not a placeholder) must exist."""
    from mlx_spec import zoo
    from mlx_spec.bench.claims import PRESETS

    def literal(w: str) -> bool:
        return not (w.isupper() or "{" in w or "<" in w or w == "...")

    if words[0] == "fetch-model" and len(words) > 1 and literal(words[1]):
        assert words[1] in zoo.MODELS, f"no zoo model {words[1]!r}"
    if "--preset" in words:
        preset = words[words.index("--preset") + 1]
        assert not literal(preset) or preset in PRESETS, f"no bench preset {preset!r}"


def check(cmd: str) -> None:
    words = _words(cmd)
    if words[0] == "python" and words[1:3] == ["-m", "mlx_spec"] or words[0] == "mlx-spec":
        rest = words[3:] if words[0] == "python" else words[1:]
        assert shutil.which("mlx-spec"), "the mlx-spec entry point is not installed"
        if not rest or rest[0] in ("...", "--help"):
            return
        if rest[0] == "launch" and "--" in rest:  # launch's own flags, then the ranks' command
            cut = rest.index("--")
            check(" ".join(["mlx-spec", *rest[cut + 1:]]))
            rest = rest[:cut]
        parser = _mlx_spec_parser(rest)
        known = {s for a in parser._actions for s in a.option_strings}
        assert _flags(rest) <= known, f"unknown flags {_flags(rest) - known}"
        _check_names(rest)
    elif words[0] in ("pip", "pip3"):
        extras = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
                     ["optional-dependencies"])
        for target in (w for w in words[2:] if not w.startswith("-")):
            local = re.fullmatch(r"\.(?:\[([\w,-]+)\])?", target)
            if local:
                assert set(filter(None, (local.group(1) or "").split(","))) <= extras, target
            else:
                name = re.split(r"[\[<>=]", target)[0]
                assert name != "mlx-spec", "mlx-spec installs from a checkout: pip install -e ."
                importlib.metadata.distribution(name)  # a package this environment has
    else:
        if words[0].startswith("python"):
            assert (ROOT / words[1]).is_file(), f"{words[1]} does not exist"
            argv = (sys.executable, words[1])
            rest = words[2:]
        else:
            assert shutil.which(words[0]), f"{words[0]} is not installed"
            sub = [words[1]] if words[0] == "hf" and len(words) > 1 else []
            argv, rest = (words[0], *sub), words[1 + len(sub):]
        text = _help(*argv)
        missing = {f for f in _flags(rest) if not re.search(rf"(?<![\w-]){re.escape(f)}(?![\w-])", text)}
        assert not missing, f"{' '.join(argv)} has no {missing}"


NAMED = all_commands()


def test_the_docs_and_messages_name_commands():
    programs = {c.split()[0] for _, c in NAMED}
    assert {"hf", "mlx-spec", "pip", "python", "mlx_lm.convert"} <= programs
    assert not [c for c in NAMED if "huggingface-cli" in c[1]]
    for where in (ROOT / "README.md", ROOT / "mlx_spec" / "load_errors.py"):
        assert any(str(where.relative_to(ROOT)) == p for p, _ in NAMED)


@pytest.mark.parametrize("where, cmd", NAMED, ids=[f"{p}: {c[:60]}" for p, c in NAMED])
def test_each_named_command_exists_with_its_flags(where, cmd):
    check(cmd)


@pytest.mark.parametrize("cmd, why", [
    ("mlx-spec fetch-model NAME --refresh", "unknown flags"),
    ("mlx-spec convert onnx SRC OUT", "no kind 'onnx'"),
    ("mlx-spec fetch-model smollm3", "no zoo model 'smollm3'"),
    ("mlx-spec bench --preset qwen-draft --claims", "no bench preset 'qwen-draft'"),
    ("hf download ORG/NAME --local-folder X", "has no"),
    ("huggingface-cli download ORG/NAME", "huggingface-cli is not installed"),
    ("python scripts/nope.py --k 4", "does not exist"),
    ("pip install -e '.[docs]'", ".[docs]"),
    ("pip install mlx-spec", "from a checkout"),
])
def test_the_check_catches_a_wrong_command(cmd, why):
    with pytest.raises(AssertionError, match=re.escape(why)):
        check(cmd)


def test_commands_are_cut_where_the_shell_cuts_them():
    text = ("python3 -m venv .venv && pip install -e . && mlx-spec generate --prompt hi\n"
            "MODEL=$(mlx-spec fetch-model qwen | tail -n 1)  # a comment --bogus\n"
            "mlx-spec generate [--draft ngram|HEAD_DIR | --draft-model PATH] \\\n    --max-tokens N\n")
    assert commands(f"```sh\n{text}```", markdown=True) == [
        "pip install -e .", "mlx-spec generate --prompt hi", "mlx-spec fetch-model qwen",
        "mlx-spec generate [--draft ngram|HEAD_DIR | --draft-model PATH] --max-tokens N"]


def test_docs_cite_public_sources_and_link_files_that_exist():
    # The project's design notes are not shipped: users cannot open them.
    private = re.compile(r"shared/design|\.\./shared|formats\.md|anchors\.md")
    texts = {p: p.read_text() for p in [*DOCS, *sorted((ROOT / "mlx_spec" / "bench").rglob("*.*"))]
             if p.suffix in (".md", ".py", ".json")}
    assert [str(p) for p, t in texts.items() if private.search(t)] == []
    for doc in DOCS:
        for target in re.findall(r"\]\(([^)\s]+)\)", doc.read_text()):
            if not re.match(r"[a-z]+:|#", target):
                assert (doc.parent / target.split("#")[0]).exists(), f"{doc.name} links {target}"
