"""`mlx-spec generate`: mlx_lm.generate's flags and defaults where they overlap, and its output."""

from __future__ import annotations

import argparse
import io

import pytest

import tiny
from mlx_spec import cli, generate_cli

# Overlapping flags whose defaults differ on purpose (listed in the README's Command line).
DIFFERENT_DEFAULTS = {"model", "num_draft_tokens", "verbose"}


def _ours(argv: list[str]) -> argparse.Namespace:
    return cli.build_parser(["generate"]).parse_args(["generate", *argv])


def test_overlapping_flags_have_mlx_lm_s_names_and_defaults():
    from mlx_lm.generate import setup_arg_parser

    theirs = {a.dest: a for a in setup_arg_parser()._actions}
    parser = argparse.ArgumentParser()
    generate_cli.add_arguments(parser)
    mine = {a.dest: a for a in parser._actions}
    shared = set(theirs) & set(mine) - {"help"}
    assert {"prompt", "max_tokens", "extra_eos_token", "system_prompt", "temp", "top_p", "top_k",
            "min_p", "seed", "ignore_chat_template", "draft_model", "verbose", "max_kv_size",
            "kv_bits", "kv_group_size", "quantized_kv_start", "prefill_step_size"} <= shared
    for dest in shared:
        assert set(theirs[dest].option_strings) <= set(mine[dest].option_strings), dest
        if dest not in DIFFERENT_DEFAULTS:
            assert mine[dest].default == theirs[dest].default, dest
    assert _ours([]).prompt == "hello" and _ours([]).max_tokens == 100


@pytest.mark.parametrize("argv, verbose", [
    ([], None), (["--verbose"], True), (["--verbose", "True"], True), (["--verbose", "T"], True),
    (["--verbose", "false"], False), (["--verbose", "F"], False), (["--verbose", "--max-tokens", "3"], True),
])
def test_verbose_takes_the_bare_flag_and_mlx_lm_s_true_false(argv, verbose):
    assert _ours(argv).verbose is verbose


def test_verbose_refuses_other_words(capsys):
    with pytest.raises(SystemExit):
        _ours(["--verbose", "maybe"])
    assert "expected True or False, got 'maybe'" in capsys.readouterr().err


def test_extra_eos_tokens_are_several():
    assert _ours(["--extra-eos-token", "<|im_end|>", "7"]).extra_eos_token == ["<|im_end|>", "7"]


def test_system_prompt_goes_into_the_chat_template_first():
    from mlx_lm.tokenizer_utils import TokenizerWrapper

    hf = tiny.tokenizer()._tokenizer
    hf.chat_template = "{% for m in messages %}{{ m.content }} {% endfor %}w9"
    tok = TokenizerWrapper(hf)
    assert tok.decode(generate_cli.encode_prompt(tok, "w5", "w7", chat=True)) == "w7 w5 w9"
    assert tok.decode(generate_cli.encode_prompt(tok, "w5", None, chat=True)) == "w5 w9"
    assert generate_cli.encode_prompt(tok, "w5", "w7", chat=False) == tok.encode("w5")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tiny.model_folder(tmp_path_factory.mktemp("cli") / "tiny")


def _run(folder, capsys, *argv: str) -> tuple[int, str, str]:
    rc = cli.main(["generate", "--model", str(folder), "--num-draft-tokens", "2", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


def test_default_output_is_mlx_lm_s_plus_a_speculation_line(folder, capsys):
    rc, out, _ = _run(folder, capsys, "--prompt", "w3 w4", "-m", "4")
    lines = out.splitlines()
    assert rc == 0 and lines[0] == "=" * 10 and lines[2] == "=" * 10
    assert lines[3].startswith("Prompt: 2 tokens, ")
    assert lines[4].startswith("Generation: 4 tokens, ") and lines[5].startswith("Peak memory: ")
    assert lines[6].startswith("Speculation: tau ") and "(NGramDrafter, draft length 2)" in lines[6]
    assert len(lines) == 7  # per-position acceptance only with an explicit --verbose


def test_verbose_false_prints_only_the_text(folder, capsys):
    _, full, _ = _run(folder, capsys, "--prompt", "w3 w4", "-m", "4")
    rc, out, _ = _run(folder, capsys, "--prompt", "w3 w4", "-m", "4", "--verbose", "False")
    assert rc == 0 and out == full.splitlines()[1] + "\n"
    _, out, _ = _run(folder, capsys, "--prompt", "w3 w4", "-m", "4", "--verbose")
    assert out.splitlines()[-1].startswith("Accepted per draft position: ")


def test_prompt_from_stdin_and_escaped_newlines(folder, capsys, monkeypatch):
    monkeypatch.setattr("sys.stdin", io.StringIO("w3 w4 w5"))
    _, out, _ = _run(folder, capsys, "--prompt", "-", "-m", "2")
    assert "Prompt: 3 tokens," in out
    _, out, _ = _run(folder, capsys, "--prompt", "w3\\nw4", "-m", "2")  # as typed in a shell
    assert "Prompt: 2 tokens," in out  # "\n" became a newline, so two words


def test_extra_eos_token_ends_generation_at_it(folder, capsys):
    _, out, _ = _run(folder, capsys, "--prompt", "w3 w4", "-m", "4", "--verbose", "False")
    first = out.split()[0]  # the first generated word
    _, out, _ = _run(folder, capsys, "--prompt", "w3 w4", "-m", "4", "--extra-eos-token", "w95", first)
    assert "Generation: 1 tokens," in out
    rc, _, err = _run(folder, capsys, "--extra-eos-token", "nonsense")
    assert rc == 2 and "error: --extra-eos-token 'nonsense' is not a token of this tokenizer" in err


def test_cache_flags_reach_the_loop(folder, capsys, monkeypatch):
    import mlx_spec

    seen = {}
    real = mlx_spec.stream_generate

    def spy(*args, **kw):
        seen.update(kw)
        return real(*args, **kw)

    monkeypatch.setattr(mlx_spec, "stream_generate", spy)
    rc, _, err = _run(folder, capsys, "--prompt", "w3 w4", "-m", "3", "--max-kv-size", "16",
                    "--kv-bits", "8", "--kv-group-size", "32", "--quantized-kv-start", "900",
                    "--prefill-step-size", "8")
    assert rc == 0, err
    assert (seen["max_kv_size"], seen["kv_bits"], seen["kv_group_size"], seen["quantized_kv_start"],
            seen["prefill_step_size"]) == (16, 8, 32, 900, 8)


def test_compare_prints_the_measured_speed_up_and_trees_and_mixed_drafters_run(folder, capsys):
    rc, out, _ = _run(folder, capsys, "--prompt", "w3 w4 w3 w4 w3", "-m", "6", "--compare",
                      "--branches", "2")
    line = next(x for x in out.splitlines() if x.startswith("Compare:"))
    assert rc == 0 and "x (same tokens" in line
    rc, out, _ = _run(folder, capsys, "--prompt", "w3 w4", "-m", "4", "--draft", "ngram+model",
                      "--draft-model", str(folder))
    assert rc == 0 and "MixedDrafter" in out
    rc, _, err = _run(folder, capsys, "--prompt", "w3", "-m", "2", "--draft", "ngram+model")
    assert rc == 2 and "needs --draft-model" in err


@pytest.mark.parametrize("flags, drafter", [
    (("--num-draft-tokens", "auto"), "DraftModelDrafter"),  # alone (its chains lookup-guided)
    (("--draft", "model", "--num-draft-tokens", "auto"), "DraftModelDrafter"),
    (("--num-draft-tokens", "3"), "DraftModelDrafter"),
    (("--draft", "ngram+model"), "MixedDrafter"),  # prompt lookup as a source of its own: asked for
])
def test_a_draft_model_drafts_alone_unless_ngram_model_is_asked_for(folder, capsys, flags, drafter):
    rc, out, err = _run(folder, capsys, "--prompt", "w3 w4", "-m", "4", "--draft-model", str(folder), *flags)
    assert rc == 0 and drafter in out, err
    rc, _, err = _run(folder, capsys, "--prompt", "w3", "-m", "2", "--draft", "model")
    assert rc == 2 and "--draft model needs --draft-model" in err
    rc, _, err = _run(folder, capsys, "--prompt", "w3", "-m", "2", "--draft", "none", "--branches", "2")
    assert rc == 2 and "--branches drafts trees with the n-gram" in err
    rc, _, err = _run(folder, capsys, "--prompt", "w3", "-m", "2", "--branches", "7")
    assert rc == 2 and "branches must be an integer in 1..4" in err


def test_tree_budget_grows_dynamic_trees_with_a_draft_model_and_refuses_bad_values(folder, capsys):
    rc, out, err = _run(folder, capsys, "--prompt", "w3 w4 w3 w4 w3", "-m", "6", "--compare",
                        "--draft-model", str(folder), "--tree-budget", "6")
    line = next(x for x in out.splitlines() if x.startswith("Compare:"))
    assert rc == 0 and "x (same tokens" in line, err
    rc, _, err = _run(folder, capsys, "--prompt", "w3", "-m", "2", "--tree-budget", "6")
    assert rc == 2 and "--tree-budget drafts trees with a draft model" in err and "not with --draft ngram" in err
    rc, _, err = _run(folder, capsys, "--prompt", "w3", "-m", "2", "--draft-model", str(folder),
                      "--tree-budget", "0")
    assert rc == 2 and "tree_budget must be an integer in 1..16" in err
    rc, _, err = _run(folder, capsys, "--prompt", "w3", "-m", "2", "--draft-model", str(folder),
                      "--tree-budget", "6", "--branches", "2")
    assert rc == 2 and "give one of them" in err


def test_no_lookup_drafts_unguided_chains(folder):
    parser = argparse.ArgumentParser()
    generate_cli.add_arguments(parser)
    for flags, lookup in (((), True), (("--no-lookup",), False)):
        args = parser.parse_args(["--draft", "model", "--draft-model", str(folder), *flags])
        drafter = generate_cli.make_drafter(args, None, str(folder))
        assert type(drafter).__name__ == "DraftModelDrafter" and drafter.lookup is lookup


def test_draft_head_vocab_sets_the_draft_models_head(folder, capsys):
    from mlx_spec.drafters.short_head import HEAD_VOCAB

    parser = argparse.ArgumentParser()
    generate_cli.add_arguments(parser)
    for flags, head in (((), HEAD_VOCAB), (("--draft-head-vocab", "0"), None), (("--draft-head-vocab", "40"), 40)):
        args = parser.parse_args(["--draft-model", str(folder), *flags])
        assert generate_cli.make_drafter(args, None, str(folder)).head_vocab == head
    rc, _, err = _run(folder, capsys, "--prompt", "w3", "-m", "2", "--draft-model", str(folder),
                      "--draft-head-vocab", "-1")
    assert rc == 2 and "--draft-head-vocab must be 0" in err


def test_compare_counts_plain_and_speculative_runs_alike_and_not_the_cold_run_shown(monkeypatch, capsys):
    """The run shown paid the speculative path's one-time costs: counting it (as an earlier
    version did) biased the speed-up against speculation. Runs here report 10 tokens/s plain
    and 20 speculative; the shown run 1: the speed-up must read 2.00x."""
    from types import SimpleNamespace

    import mlx_spec
    from mlx_spec import generate_cli

    calls = []

    def fake(model, tokenizer, ids, drafter, **options):
        calls.append((drafter is not None, options["max_tokens"]))
        yield SimpleNamespace(token=7, stats=SimpleNamespace(generation_tps=20.0 if drafter else 10.0))

    monkeypatch.setattr(mlx_spec, "stream_generate", fake)
    first = SimpleNamespace(stats=SimpleNamespace(generation_tps=1.0))
    generate_cli._compare(None, None, [1], object(), {"max_tokens": 16}, first, [7])
    line = capsys.readouterr().out
    assert "plain 10.00 tokens-per-sec, speculative 20.00 tokens-per-sec: 2.00x (same tokens" in line
    counted = [spec for spec, n in calls if n == 16]
    assert counted.count(True) == counted.count(False) == 2 and counted == counted[::-1]  # ABBA


@pytest.mark.parametrize("command, flags, says", [
    ("generate", ["--num-draft-tokens", "0"], "expected an integer 1..16 or auto, got '0'"),
    ("generate", ["--num-draft-tokens", "17"], "expected an integer 1..16 or auto, got '17'"),
    ("generate", ["--temp", "-1"], "--temp: expected a number >= 0, got '-1'"),
    ("generate", ["--top-p", "2"], "--top-p: expected a number 0..1, got '2'"),
    ("generate", ["--max-tokens", "0"], "expected an integer >= 1, got '0'"),
    ("generate", ["--kv-bits", "7"], "--kv-bits: invalid choice: 7"),
    ("serve", ["--num-draft-tokens", "0"], "expected an integer 1..16 or auto, got '0'"),
    ("serve", ["--port", "99999"], "--port: expected an integer 0..65535, got '99999'"),
    ("generate", ["--dist-timeout=-5"], "--dist-timeout: expected a number >= 0, got '-5'"),  # (killed every rank)
])
def test_settings_out_of_range_are_refused_before_any_model_loads(monkeypatch, capsys, command, flags, says):
    """(A server with --num-draft-tokens 0 used to start, then refuse every request naming a
    field its clients never sent; generate printed its header before the error.)"""
    import mlx_spec

    monkeypatch.setattr(mlx_spec, "load", lambda *a, **k: pytest.fail("a model was loaded"))
    with pytest.raises(SystemExit) as e:
        cli.main([command, "--model", "nowhere", *flags])
    out, err = capsys.readouterr()
    assert e.value.code == 2 and says in err and out == ""


def test_an_empty_prompt_or_an_empty_pipe_is_an_error_not_an_answer_to_nothing(folder, capsys, monkeypatch):
    rc, out, err = _run(folder, capsys, "--prompt", "")
    assert rc == 2 and "the prompt is empty: give some text" in err and out == ""
    monkeypatch.setattr("sys.stdin", io.StringIO(""))
    rc, out, err = _run(folder, capsys, "--prompt", "-")
    assert rc == 2 and "(nothing came on stdin)" in err and out == ""
    monkeypatch.setattr("sys.stdin", io.StringIO("w3 w4"))
    assert _run(folder, capsys, "--prompt", "-", "-m", "2")[0] == 0


def test_a_sharded_rank_whose_peer_ended_gets_one_error_line(monkeypatch, capsys):
    def lost(args, prompt):
        raise RuntimeError("[ring] connection to a peer was lost")

    monkeypatch.setattr(generate_cli, "_generate", lost)
    monkeypatch.setenv("MLX_RANK", "1")  # as mlx.launch sets it
    assert cli.main(["generate", "--shard", "pipeline", "--prompt", "w5"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: rank 1: stopped: [ring] connection to a peer was lost")
    assert "its own error says why" in err and "Traceback" not in err
    with pytest.raises(RuntimeError):  # unsharded, a RuntimeError is a bug: its traceback stays
        cli.main(["generate", "--prompt", "w5"])
    monkeypatch.setattr(generate_cli, "_generate", lambda args, prompt: mlx_spec_load_fails())
    assert cli.main(["generate", "--shard", "pipeline", "--prompt", "w5"]) == 2  # any sharded error
    assert capsys.readouterr().err.startswith("error: rank 1: no such model")  # names its rank


def mlx_spec_load_fails():
    raise ValueError("no such model")
