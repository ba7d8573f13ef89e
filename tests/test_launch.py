"""`mlx-spec launch` itself, without models: what it hands the ranks, and that the ranks end
with it. Processes are local, bounded by timeouts, and stop by themselves."""

from __future__ import annotations

import argparse
import io
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from mlx_spec import generate_cli, launch


@pytest.mark.parametrize("given", [["--prompt", "-"], ["-p", "-"], ["--prompt=-"], ["-p-"]])
@pytest.mark.parametrize("text", ['def f():\n    return "a\\nb"\n', "---\ntitle: x\n---\n"])
def test_a_stdin_prompt_is_read_once_and_given_to_every_rank_as_it_is(monkeypatch, given, text):
    """The ranks' stdin is a pipe nobody writes to (they waited on it for good); the text reaches
    them untouched, its backslash sequences included (a --prompt's \\n would become a newline),
    and a text starting with a dash too."""
    monkeypatch.setattr(sys, "stdin", io.StringIO(text))
    command = launch._read_stdin_prompt(["--", "generate", "--shard", "pipeline", *given, "-m", "8"])
    assert command == ["--", "generate", "--shard", "pipeline", f"--prompt-verbatim={text}", "-m", "8"]
    parser = argparse.ArgumentParser()
    generate_cli.add_arguments(parser)
    assert generate_cli.prompt_text(parser.parse_args(command[2:])) == text
    assert generate_cli.prompt_text(parser.parse_args(["--prompt", "x\\ny"])) == "x\ny"  # as mlx_lm.generate
    assert launch._read_stdin_prompt(["serve", "--shard", "pipeline", "--prompt", "-"])[-1] == "-"


def test_a_stdin_prompt_too_long_for_a_command_line_is_refused(monkeypatch, capsys):
    monkeypatch.setattr(sys, "stdin", io.StringIO("x" * (launch.MAX_ARG + 1)))
    args = argparse.Namespace(command=["generate", "--shard", "pipeline", "--prompt", "-"], dry_run=False,
                              timeout=None, repeat_hosts=2, hosts=None, hostfile=None, backend="ring",
                              starting_port=None)
    assert launch.run(args) == 2
    assert "the prompt read from stdin takes 100,001 bytes quoted" in capsys.readouterr().err
    # each ' grows to 5 bytes in the shell command mlx.launch gives a rank: 40 KB of them did not
    # fit Linux's 128 KiB argument, and mlx.launch failed in threads and exited 0
    monkeypatch.setattr(sys, "stdin", io.StringIO("w5 " + "'" * 40_000))
    assert launch.run(args) == 2
    assert "takes 200,0" in capsys.readouterr().err
    monkeypatch.setattr(sys, "stdin", io.StringIO(" \n"))
    assert launch.run(args) == 2 and "the prompt is empty (nothing came on stdin)" in capsys.readouterr().err


def test_launch_reads_every_rank_failure_note_and_the_shard_flag_in_either_form():
    failed = []
    launch._relay(io.StringIO("[WARN] Node with rank 1 exited with code 1 [WARN] Node with rank 0 exited "
                              "with code 1\nException in thread Thread-2:\n"), failed)
    assert failed == [(1, 1), (0, 1), (None, 1)]
    args = argparse.Namespace(command=["--", "generate", "--shard=pipeline"], repeat_hosts=2, hosts=None,
                              hostfile=None, backend="ring", starting_port=None)
    assert "--shard=pipeline" in launch.launch_command(args)


def _alive(pid: int) -> bool:
    state = subprocess.run(["ps", "-o", "stat=", "-p", str(pid)], capture_output=True, text=True).stdout.strip()
    return bool(state) and not state.startswith("Z")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_the_ranks_end_when_the_launch_is_told_to(sig):
    """The ranks run in a session of their own: a launch ended by SIGTERM (a CI timeout, kill) or
    SIGHUP (a closed terminal) ends them first, instead of leaving them running for good."""
    script = textwrap.dedent("""
        import argparse, sys
        from mlx_spec import launch
        rank = ("import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', "
                "'import time; time.sleep(60)']); print(p.pid, flush=True); time.sleep(60)")
        launch.launch_command = lambda args: [sys.executable, "-c", rank]
        args = argparse.Namespace(command=["generate", "--shard", "pipeline"], dry_run=False, timeout=120)
        sys.exit(launch.run(args))
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        rank = int(proc.stdout.readline())
        assert _alive(rank)
        proc.send_signal(sig)
        assert proc.wait(timeout=30) == 128 + sig
        deadline = time.monotonic() + 15
        while _alive(rank) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _alive(rank)
    finally:
        os.killpg(proc.pid, signal.SIGKILL) if proc.poll() is None else None

