"""`mlx-spec serve` as a command (it announces itself, serves, stops on SIGTERM, warns, names
its extra), and the text handling units: stop strings cut exactly however the text arrives,
tool calls parsed with mlx-lm's own parser wherever the text splits."""

from __future__ import annotations

import openai

import tiny
from server_utils import word_tokenizer


def test_stop_strings_are_cut_exactly_however_the_text_arrives():
    from mlx_spec.server.text import StopCutter

    text, stops = "one two STOP three xyz", ["xyz", "STOP", "TOPS"]
    for i in range(len(text) + 1):
        for j in range(i, len(text) + 1):
            cut = StopCutter(stops)
            sent = "".join(cut.feed(piece) for piece in (text[:i], text[i:j], text[j:]))
            assert sent == "one two " and cut.matched == "STOP"
    cut = StopCutter(stops)
    assert cut.feed("one ST") == "one " and cut.feed("OMP") == "STOMP" and cut.flush() == ""
    assert cut.feed(" x") == " " and cut.flush() == "x"  # held back until the end


def test_tool_calls_are_parsed_with_mlx_lms_own_parser_wherever_the_text_splits():
    from mlx_lm.tool_parsers import json_tools

    from mlx_spec.server.text import Router, make_machine

    tok = word_tokenizer(tool_call_start=json_tools.tool_call_start, tool_call_end=json_tools.tool_call_end,
                         tool_parser=json_tools.parse_tool_call)
    text = 'Sure.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    for i in range(len(text) + 1):
        router = Router(tok, make_machine(tok), [5, 6], None)
        a, b = router.feed(text[:i]), router.feed(text[i:], end="eos")
        assert a.content + b.content == "Sure."
        assert a.tool_calls + b.tool_calls == [{"name": "get_weather", "arguments": {"city": "Paris"}}]
        assert router.called


def test_serve_prints_its_url_serves_and_stops_cleanly_on_sigterm(tmp_path):
    import os
    import signal
    import subprocess
    import sys

    folder = tiny.model_folder(tmp_path / "tiny", eos=None)
    env = {**os.environ, "MLX_SPEC_NO_BLAS_PRELOAD": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "mlx_spec", "serve", "--model", str(folder),
                             "--draft", "ngram", "--num-draft-tokens", "3", "--port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = proc.stdout.readline()  # printed once it listens
        assert f"model '{folder}'" in line and "drafter: ngram" in line, proc.stderr.read()
        url = line.split(" at ")[-1].strip()
        c = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=60)
        assert [m.id for m in c.models.list()] == [str(folder)]
        r = c.completions.create(model=str(folder), prompt="w5 w6 w7", max_tokens=5, temperature=0)
        assert r.usage.completion_tokens == 5
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        assert "stopped" in proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def test_serve_warns_when_listening_beyond_this_machine_without_a_key_and_names_the_extra(
        capsys, monkeypatch):
    import argparse
    import importlib.util

    from mlx_spec.server import cli as serve

    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    # --draft with --draft-model ends the command before anything binds or loads
    args = parser.parse_args(["--host", "0.0.0.0", "--draft", "ngram", "--draft-model", "x"])
    assert serve.run(args) == 2
    err = capsys.readouterr().err
    assert "without --api-key" in err and "alternatives" in err
    args = parser.parse_args(["--host", "0.0.0.0", "--api-key", "k", "--draft", "ngram", "--draft-model", "x"])
    assert serve.run(args) == 2 and "without --api-key" not in capsys.readouterr().err
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "uvicorn" else real(name, *a))
    assert serve.run(args) == 2
    assert "pip install -e '.[server]'" in capsys.readouterr().err
