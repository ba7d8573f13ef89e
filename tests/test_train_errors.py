"""Bad input to `mlx-spec train` fails before any work (no data generated, no folder written),
with one message naming the problem and the fix."""

from __future__ import annotations

import json

import mlx.core as mx
import pytest

import mlx_spec
import tiny
from mlx_spec.cli import main as cli_main
from mlx_spec.drafters.eagle import Eagle3Head
from mlx_spec.train.data import DataError, user_header
from mlx_spec.train.export import head_config, write_head
from mlx_spec.train.run import realign, train_eagle3

TEMPLATE = "{% for m in messages %}w2 {{ m['content'] }} w3 {% endfor %}{% if add_generation_prompt %}w4{% endif %}"
PROMPTS = [[{"role": "user", "content": f"w{5 + i} w{9 + i} w{13 + i}"}] for i in range(4)]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tiny.model_folder(tmp_path_factory.mktemp("t") / "model", layers=6, eos=None, chat_template=TEMPLATE)


@pytest.fixture(scope="module")
def target(folder):
    return mlx_spec.load(str(folder))


def _fail(fn, match, out):
    with pytest.raises(ValueError, match=match):
        fn()
    assert not out.exists() or not (out / "data.jsonl").exists()


def test_prompts_file_without_usable_rows(tmp_path, folder, capsys):
    bad = tmp_path / "prompts.jsonl"
    bad.write_text('{"text": "no prompt field"}\nnot json\n{"messages": []}\n{"prompt": "  "}\n')
    out = tmp_path / "out"
    # the model is never loaded: a wrong --model would fail later than the prompts file
    code = cli_main(["train", "eagle3", "--model", str(tmp_path / "no-such-model"), "--out", str(out),
                     "--prompts", str(bad)])
    err = capsys.readouterr().err
    assert code == 2 and "no usable rows" in err and "4 unreadable" in err and '{"prompt": ' in err
    assert not out.exists()


@pytest.mark.parametrize("vocab,taps,match", [
    (97, [1, 2, 4], r"--draft-vocab 97 is larger than the target's vocabulary \(96\); pass at most 96"),
    (32, [1, 2, 9], r"--tap-layers \[9\]: the target has decoder layers 0..5"),
])
def test_draft_vocab_or_taps_the_target_lacks(tmp_path, target, vocab, taps, match):
    model, tok = target
    out = tmp_path / "out"
    _fail(lambda: train_eagle3(model, tok, out, prompts=PROMPTS, draft_vocab=vocab, tap_layers=taps), match, out)
    assert not out.exists()


def test_unknown_init_fails_before_any_work(tmp_path, target):
    model, tok = target
    out = tmp_path / "out"
    _fail(lambda: train_eagle3(model, tok, out, prompts=PROMPTS, draft_vocab=32, tap_layers=[1, 2, 4],
                               init="zeros"), r"--init 'zeros': choose one of target, random", out)
    assert not out.exists()


def test_head_made_for_another_target(tmp_path, target):
    model, tok = target
    other = tiny.llama_model(layers=6, hidden=32)
    head_dir = tmp_path / "head"
    write_head(head_dir, Eagle3Head(head_config(other, [1, 2, 4], 32)), head_config(other, [1, 2, 4], 32),
               mx.arange(32, dtype=mx.int32))
    out = tmp_path / "out"
    _fail(lambda: realign(model, tok, head_dir, out, prompts=PROMPTS),
          r"converted for another target \(hidden_size: head made for 32, target has 64\)", out)
    assert not out.exists()


def test_resume_with_another_target_or_without_a_run(tmp_path, target):
    model, tok = target
    out = tmp_path / "out"
    _fail(lambda: train_eagle3(model, tok, out, resume=True), "holds no checkpoint of a training run", out)
    train_eagle3(model, tok, out, prompts=PROMPTS, draft_vocab=32, tap_layers=[1, 2, 4], steps=2,
                 eval_prompts=1, eval_tokens=2, max_length=16, log=lambda m: None)
    before = (out / "model.safetensors").read_bytes()
    other = tiny.llama_model(layers=8)
    with pytest.raises(ValueError, match=r"another target \(num_hidden_layers: head made for 6, target has 8\)"):
        train_eagle3(other, tok, out, resume=True)
    with pytest.raises(ValueError, match="exists and is not empty; pass --resume"):
        train_eagle3(model, tok, out, prompts=PROMPTS, draft_vocab=32, tap_layers=[1, 2, 4])
    assert (out / "model.safetensors").read_bytes() == before
    assert json.loads((out / "state.json").read_text())["step"] == 2


def test_no_chat_template_and_no_prompts(tmp_path):
    with pytest.raises(DataError, match="no chat template.*pass --prompts FILE"):
        user_header(tiny.tokenizer())


def test_unknown_magpie_topic_fails_before_any_generation(tmp_path, target):
    model, tok = target
    out = tmp_path / "out"
    _fail(lambda: train_eagle3(model, tok, out, topics=("chat", "poetry"), draft_vocab=32, tap_layers=[1, 2, 4]),
          r"--magpie-topics chat,poetry: choose from chat, code", out)


def test_a_topic_system_turn_comes_before_the_user_header(target):
    _, tok = target
    plain, steered = user_header(tok), user_header(tok, "w7 w8")
    assert steered != plain and tok.decode(steered).split() == ["w2", "w7", "w8", "w3", "w2"]


QUICK = dict(draft_vocab=32, tap_layers=[1, 2, 4], steps=1, eval_prompts=1, eval_tokens=2, max_length=24,
             log=lambda m: None)


@pytest.mark.parametrize("bad, match", [
    (dict(steps=0), "--steps must be a whole number >= 1"), (dict(eval_k=0), "--eval-k must be a draft length"),
    (dict(eval_k=17), "--eval-k must be a draft length"), (dict(ttt_steps=0), "--ttt-steps must be"),
    (dict(checkpoint_every=0), "--checkpoint-every must be"), (dict(log_every=0), "--log-every must be"),
    (dict(eval_prompts=0), "--eval-prompts must be"), (dict(lr=-1.0), "--lr must be more than 0"),
    (dict(epochs=0, steps=None), "--epochs must be more than 0"),
    (dict(tap_layers=[2, 2, 4]), r"--tap-layers \[2, 2, 4\]: each layer at most once"),
    (dict(seed=-1), r"--seed must be a whole number 0\.\.4294967295, got -1"),  # (failed after the data)
])
def test_settings_that_cannot_run_fail_before_any_work(tmp_path, target, bad, match):
    model, tok = target
    out = tmp_path / "out"
    _fail(lambda: train_eagle3(model, tok, out, prompts=PROMPTS, **{**QUICK, **bad}), match, out)
    assert not out.exists()


def test_an_out_path_that_is_a_file_is_refused(tmp_path, target):
    model, tok = target
    (tmp_path / "out").write_text("")
    _fail(lambda: train_eagle3(model, tok, tmp_path / "out", prompts=PROMPTS, **QUICK), "is a file; give a folder",
          tmp_path / "none")


def test_samples_draw_from_a_prompts_file_and_skipped_lines_are_told(tmp_path, target, caplog):
    model, tok = target
    rows = [json.dumps({"prompt": f"w{5 + i % 80} w{7 + i % 80}"}) for i in range(40)] + ["not json"]
    (tmp_path / "p.jsonl").write_text("\n".join(rows) + "\n")
    train_eagle3(model, tok, tmp_path / "out", prompts=str(tmp_path / "p.jsonl"), samples=5, **QUICK)
    assert len((tmp_path / "out" / "data.jsonl").read_text().splitlines()) == 5  # not all 39 left
    assert "1 of 41 rows skipped" in caplog.text
    # as many held out as asked, with prompts enough (it held out 2 and trained on 11 here)
    train_eagle3(model, tok, tmp_path / "out8", prompts=str(tmp_path / "p.jsonl"), samples=5,
                 **{**QUICK, "eval_prompts": 8})
    assert len((tmp_path / "out8" / "data.jsonl").read_text().splitlines()) == 5
    assert len((tmp_path / "out8" / "eval.jsonl").read_text().splitlines()) == 8


def test_prompts_the_chat_template_refuses_are_skipped_and_told(tmp_path):
    """Templates such as Mistral's and Gemma's raise on two user turns in a row: such a row,
    held out, used to end the run in its evaluation, after all the training, on every resume."""
    strict = ("{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
              "{{ raise_exception('Conversation roles must alternate') }}{% endif %}"
              "w2 {{ m['content'] }} w3 {% endfor %}{% if add_generation_prompt %}w4{% endif %}")
    model, tok = mlx_spec.load(str(tiny.model_folder(tmp_path / "m", layers=6, eos=None, chat_template=strict)))
    bad = [{"role": "user", "content": "w5 w6"}, {"role": "user", "content": "w7 w8"}]
    said = []
    train_eagle3(model, tok, tmp_path / "out", prompts=[bad] + PROMPTS, **{**QUICK, "log": said.append})
    assert any("skipped 1 prompt(s) the chat template refuses" in m for m in said)
    assert (tmp_path / "out" / "eval.json").is_file()
    held = [json.loads(r)["messages"] for r in (tmp_path / "out" / "eval.jsonl").read_text().splitlines()]
    assert bad not in held


def test_export_refuses_a_folder_that_is_not_a_head_its_own_folder_and_a_training_run(tmp_path, target):
    from mlx_spec.train.export import export

    model, tok = target
    train_eagle3(model, tok, tmp_path / "a", prompts=PROMPTS, **QUICK)
    train_eagle3(model, tok, tmp_path / "b", prompts=PROMPTS, **QUICK)
    with pytest.raises(ValueError, match="is the head's own folder"):
        export(tmp_path / "a", tmp_path / "a", "midlayer", force=True)
    with pytest.raises(ValueError, match=r"holds a training run \(train\.json"):
        export(tmp_path / "a", tmp_path / "b", "midlayer", force=True)
    assert (tmp_path / "b" / "data.jsonl").is_file()  # (it used to be deleted)
    with pytest.raises(ValueError, match="is not an EAGLE-3 head folder of mlx-spec"):
        export(tmp_path / "b" / "nowhere", tmp_path / "c", "midlayer")


def test_runs_resume_only_as_their_own_kind_and_data_only_for_its_target(tmp_path, target):
    model, tok = target
    head = tmp_path / "head"
    cfg = head_config(model, [1, 2, 4], 32)
    write_head(head, Eagle3Head(cfg), cfg, mx.arange(32, dtype=mx.int32))
    out = tmp_path / "realigned"
    realign(model, tok, head, out, prompts=PROMPTS, **{k: v for k, v in QUICK.items() if k not in ("draft_vocab", "tap_layers")})
    with pytest.raises(ValueError, match="holds a train realign run; resume it with `mlx-spec train realign"):
        train_eagle3(model, tok, out, resume=True)
    other = tiny.llama_model(layers=8)
    with pytest.raises(ValueError, match=r"--data-from .* another target"):
        train_eagle3(other, tok, tmp_path / "new", data_from=out, **{**QUICK, "tap_layers": [1, 2, 4]})
    assert not (tmp_path / "new").exists()


def test_a_realign_stopped_in_its_first_evaluation_resumes(tmp_path, target, monkeypatch):
    """The data and step 0 are kept before the published head's evaluation, which a resumed
    run makes again."""
    from mlx_spec.train import run as run_mod

    model, tok = target
    head = tmp_path / "head"
    cfg = head_config(model, [1, 2, 4], 32)
    write_head(head, Eagle3Head(cfg), cfg, mx.arange(32, dtype=mx.int32))
    evaluate = run_mod.evaluate

    def stopped(*a, **kw):
        raise KeyboardInterrupt

    monkeypatch.setattr(run_mod, "evaluate", stopped)
    quick = {k: v for k, v in QUICK.items() if k not in ("draft_vocab", "tap_layers")}
    with pytest.raises(KeyboardInterrupt):
        realign(model, tok, head, tmp_path / "out", prompts=PROMPTS, **quick)
    monkeypatch.setattr(run_mod, "evaluate", evaluate)
    report = realign(model, tok, None, tmp_path / "out", resume=True, log=lambda m: None)
    assert set(report) == {"before", "after"} and report["before"]["identical_to_plain"]


def test_flags_given_with_resume_must_be_the_runs_own(tmp_path, target, capsys):
    """--resume continues with the run's settings: a flag that would be ignored is refused by name,
    before the model is loaded (the --model here does not exist); the run's own values pass."""
    model, tok = target
    out = tmp_path / "out"
    train_eagle3(model, tok, out, prompts=PROMPTS, **QUICK)
    head = tmp_path / "head"
    cfg = head_config(model, [1, 2, 4], 32)
    write_head(head, Eagle3Head(cfg), cfg, mx.arange(32, dtype=mx.int32))
    realigned = tmp_path / "realigned"
    realign(model, tok, head, realigned, prompts=PROMPTS,
            **{k: v for k, v in QUICK.items() if k not in ("draft_vocab", "tap_layers")})
    eagle = ["train", "eagle3", "--model", str(tmp_path / "no-such-model"), "--out", str(out), "--resume"]
    again = ["train", "realign", "--model", str(tmp_path / "no-such-model"), "--out", str(realigned), "--resume"]
    for argv, says in [
        (eagle + ["--lr", "0.01"], "--lr 0.01 (the run has 0.0003)"),
        (eagle + ["--steps", "40", "--eval-tokens", "2"], "--steps 40 (the run has 1)"),
        (eagle + ["--init", "random"], "--init random (the run has target)"),
        (eagle + ["--tap-layers", "1,2,4"], "--tap-layers 1,2,4 (fixed when the run made its data and head)"),
        (eagle + ["--samples", "9"], "--samples 9 (fixed when"),
        (eagle + ["--epochs", "2"], "--epochs 2.0 (the run is 1 optimizer steps long, fixed when it started)"),
        (again + ["--drafter", str(out)], f"--drafter {out} (the run has {head.resolve()})"),
        (again + ["--drafter", str(head), "--eval-k", "3"], "--eval-k 3 (the run has 4)"),
    ]:
        assert cli_main(argv) == 2
        err = capsys.readouterr().err
        assert "--resume continues" in err and says in err, (argv, err)
    for argv in (eagle + ["--steps", "1", "--eval-tokens", "2", "--lr", "3e-4"], again + ["--drafter", str(head)],
                 eagle + ["--feature-cache-gb", "0", "--log-every", "3", "--checkpoint-every", "5"]):  # may change
        with pytest.raises(Exception) as e:  # past the check: loading the model fails
            assert cli_main(argv) != 0
            raise AssertionError(capsys.readouterr().err)
        assert "--resume continues" not in str(e.value)


def test_a_bfloat16_head_is_realigned_on_a_float32_copy(tmp_path, target):
    """Steps of lr 1e-5 are below a bfloat16 weight's resolution: trained in bfloat16, the head
    would come out (nearly) unchanged."""
    from mlx.utils import tree_flatten

    model, tok = target
    head = tmp_path / "head"
    cfg = head_config(model, [1, 2, 4], 32)
    net = Eagle3Head(cfg)
    net.set_dtype(mx.bfloat16)
    write_head(head, net, cfg, mx.arange(32, dtype=mx.int32))
    before = dict(tree_flatten(net.parameters()))
    out = tmp_path / "out"
    quick = {k: v for k, v in QUICK.items() if k not in ("draft_vocab", "tap_layers")}
    report = realign(model, tok, head, out, prompts=PROMPTS, lr=1e-5, **{**quick, "steps": 2})
    after = mx.load(str(out / "model.safetensors"))
    w = "layers.0.self_attn.q_proj.weight"
    assert after[w].dtype == mx.float32 and before[w].dtype == mx.bfloat16
    moved = (after[w] != before[w].astype(mx.float32)).mean().item()
    assert moved > 0.5, moved  # in bfloat16, about none of them move
    assert report["before"]["identical_to_plain"] and report["after"]["identical_to_plain"]


def test_a_resumed_run_takes_new_memory_and_logging_settings(tmp_path, target, monkeypatch):
    """--feature-cache-gb (a run stopped for memory resumes with less), --log-every and
    --checkpoint-every change neither the data, the schedule nor the weights."""
    from mlx_spec.train import run as run_mod

    model, tok = target
    out = tmp_path / "out"
    train_eagle3(model, tok, out, prompts=PROMPTS, **QUICK)
    seen, real = [], run_mod.Trainer

    def spy(*args, **kw):
        seen.append(args[6])  # its Settings
        return real(*args, **kw)

    monkeypatch.setattr(run_mod, "Trainer", spy)
    train_eagle3(model, tok, out, resume=True, log=lambda m: None,
                 resume_with={"feature_cache_gb": 0.0, "log_every": 3})
    assert (seen[0].feature_cache_gb, seen[0].log_every, seen[0].steps) == (0.0, 3, 1)
