"""`train eagle3` / `train realign` end to end on a tiny target: a head overfit on a handful of
samples drafts well through the real decode loop, a run stopped and resumed ends with the same
weights as one that never stopped, both export layouts convert back and decode losslessly."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest

import mlx_spec
import tiny
from mlx_spec.train.evaluate import evaluate
from mlx_spec.cli import main as cli_main
from mlx_spec.train.run import realign, train_eagle3

TEMPLATE = ("{% for m in messages %}w2 {{ m['content'] }} w3 {% endfor %}"
            "{% if add_generation_prompt %}w4{% endif %}")
PROMPTS = [[{"role": "user", "content": " ".join(f"w{5 + (7 * i + 3 * j) % 90}" for j in range(6))}]
           for i in range(5)]
FAST = dict(draft_vocab=64, tap_layers=[1, 2, 4], eval_prompts=1, log=lambda m: None)


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    folder = tiny.model_folder(tmp_path_factory.mktemp("target") / "model", layers=6, eos=None,
                               chat_template=TEMPLATE)
    return (folder, *mlx_spec.load(str(folder)))


@pytest.fixture(scope="module")
def trained(target, tmp_path_factory):
    folder, model, tok = target
    out = tmp_path_factory.mktemp("run") / "head"
    figures = train_eagle3(model, tok, out, prompts=PROMPTS, max_length=48, steps=500, lr=3e-3, ttt_steps=4,
                           eval_tokens=30, **FAST)
    return out, figures


def _tokens(model, tok, prompt, drafter, n=30, k=4):
    out = list(mlx_spec.stream_generate(model, tok, prompt, drafter, max_tokens=n, num_draft_tokens=k))
    return [r.token for r in out], out[-1].stats


def test_overfit_head_drafts_its_training_answers_through_the_decode_loop(target, trained):
    _, model, tok = target
    out, figures = trained
    assert json.loads((out / "eval.json").read_text()) == figures  # held-out figures are written
    assert figures["identical_to_plain"] and len(figures["acceptance_per_position"]) == 4
    train_prompts = [json.loads(r) for r in (out / "data.jsonl").read_text().splitlines()]
    assert len(train_prompts) == 4
    got = evaluate(model, tok, mlx_spec.load_drafter(out, model), PROMPTS[1:], k=4, max_tokens=30,
                   log=lambda m: None)
    assert got["identical_to_plain"]
    assert got["tau"] > 2.5, got


@pytest.mark.parametrize("layout", ["midlayer", "speculators"])
def test_exports_convert_back_and_decode_losslessly(target, trained, tmp_path, layout):
    folder, model, tok = target
    out, _ = trained
    exported, back = tmp_path / "export", tmp_path / "back"
    assert cli_main(["train", "export", str(out), str(exported), "--layout", layout, "--model", str(folder)]) == 0
    names = set(mx.load(str(exported / "model.safetensors")))
    assert {"d2t", "t2d", "fc.weight", "lm_head.weight"} <= names
    assert ("midlayer.hidden_norm.weight" in names) == (layout == "midlayer")
    assert ("embed_tokens.weight" in names) == (layout == "speculators")
    assert cli_main(["convert", "head", str(exported), str(back), "--target", str(folder)]) == 0  # format: auto
    a, b = mx.load(str(out / "model.safetensors")), mx.load(str(back / "model.safetensors"))
    assert set(a) == set(b)
    for k in a:
        np.testing.assert_array_equal(np.array(a[k]), np.array(b[k]), err_msg=k)
    prompt = tok.apply_chat_template(PROMPTS[2], add_generation_prompt=True)
    plain, _ = _tokens(model, tok, prompt, None)
    mine, s1 = _tokens(model, tok, prompt, mlx_spec.load_drafter(out, model))
    theirs, s2 = _tokens(model, tok, prompt, mlx_spec.load_drafter(back, model))
    assert mine == plain and theirs == plain
    assert s2.accepted_at_position == s1.accepted_at_position and s1.accepted > 0


class Stop(Exception):
    pass


def test_resumed_run_equals_uninterrupted_run(target, tmp_path):
    _, model, tok = target
    kw = dict(prompts=PROMPTS, max_length=24, steps=8, lr=3e-3, ttt_steps=2, checkpoint_every=3,
              eval_tokens=4, **FAST)
    train_eagle3(model, tok, tmp_path / "whole", **kw)

    def stop(step):
        if step == 5:  # two steps after the checkpoint at 3: those are lost and redone
            raise Stop

    with pytest.raises(Stop):
        train_eagle3(model, tok, tmp_path / "split", on_step=stop, **kw)
    assert json.loads((tmp_path / "split" / "state.json").read_text())["step"] == 3
    data = (tmp_path / "split" / "data.jsonl").read_text()
    train_eagle3(model, tok, tmp_path / "split", resume=True, log=lambda m: None)
    assert (tmp_path / "split" / "data.jsonl").read_text() == data  # read back, not regenerated
    a = mx.load(str(tmp_path / "whole" / "model.safetensors"))
    b = mx.load(str(tmp_path / "split" / "model.safetensors"))
    for k in a:
        np.testing.assert_array_equal(np.array(a[k]), np.array(b[k]), err_msg=k)
    # another run on the same data: nothing generated, the same rows and held-out prompts
    train_eagle3(model, tok, tmp_path / "again", data_from=tmp_path / "whole",
                 **{**kw, "prompts": None, "steps": 1})
    for name in ("data.jsonl", "eval.jsonl"):
        assert (tmp_path / "again" / name).read_text() == (tmp_path / "whole" / name).read_text()
    o1 = mx.load(str(tmp_path / "whole" / "checkpoint.safetensors"))
    o2 = mx.load(str(tmp_path / "split" / "checkpoint.safetensors"))
    assert any(k.startswith("opt/") for k in o1) and any(k.startswith("head/") for k in o1)
    assert set(o1) == set(o2) and all(np.array_equal(np.array(o1[k]), np.array(o2[k])) for k in o1)


class Killed(BaseException):
    pass


@pytest.mark.parametrize("file, at", [("checkpoint.safetensors", "4"), ("model.safetensors", "4"),
                                      ("checkpoint.safetensors", "6")])
def test_a_run_killed_while_saving_resumes_to_the_same_weights(target, tmp_path, monkeypatch, file, at):
    """Killed just after writing `file` of the checkpoint at step `at` (the checkpoint file is
    whole; the loadable head, or state.json, not yet): resuming gives the uninterrupted run's
    weights, from that checkpoint or the one before. At the last step there is nothing left to
    train: the loadable head and state.json are brought up to the checkpoint before the
    evaluation (it used to evaluate, and leave, the head of the checkpoint before)."""
    from mlx_spec.train import export, trainer

    _, model, tok = target
    kw = dict(prompts=PROMPTS, max_length=24, steps=6, lr=3e-3, ttt_steps=2, checkpoint_every=2,
              eval_tokens=4, **FAST)
    train_eagle3(model, tok, tmp_path / "whole", **kw)
    real = export.save_tensors

    def dies(path, tensors, metadata=None):
        real(path, tensors, metadata)
        if (metadata or {}).get("step") == at and path.name == file:
            raise Killed

    for module in (export, trainer):
        monkeypatch.setattr(module, "save_tensors", dies)
    with pytest.raises(Killed):
        train_eagle3(model, tok, tmp_path / "split", **kw)
    for module in (export, trainer):
        monkeypatch.setattr(module, "save_tensors", real)
    assert json.loads((tmp_path / "split" / "state.json").read_text())["step"] == int(at) - 2
    train_eagle3(model, tok, tmp_path / "split", resume=True, log=lambda m: None)
    assert json.loads((tmp_path / "split" / "state.json").read_text())["step"] == 6
    a = mx.load(str(tmp_path / "whole" / "model.safetensors"))
    b = mx.load(str(tmp_path / "split" / "model.safetensors"))
    assert set(a) == set(b)
    for k in a:
        np.testing.assert_array_equal(np.array(a[k]), np.array(b[k]), err_msg=k)


def test_realign_to_another_target_reports_tau_before_and_after(target, trained, tmp_path_factory):
    _, _, tok = target
    out, _ = trained
    model = tiny.llama_model(seed=7, layers=6)  # same shapes, other weights: a "fine-tune"
    dest = tmp_path_factory.mktemp("realign") / "head"
    # 30 prompts, two held out and answered for 60 tokens: with 5 prompts and one 30-token
    # answer the measured tau moved by more than the margin between MLX releases (0.32.4).
    prompts = [[{"role": "user", "content": " ".join(f"w{5 + (7 * i + 3 * j) % 90}" for j in range(6))}]
               for i in range(30)]
    report = realign(model, tok, out, dest, prompts=prompts, max_length=44, steps=300, lr=3e-3, ttt_steps=3,
                     eval_tokens=60, eval_prompts=2, log=lambda m: None)
    assert json.loads((dest / "eval.json").read_text()) == report
    assert report["before"]["identical_to_plain"] and report["after"]["identical_to_plain"]
    assert report["after"]["tau"] > report["before"]["tau"] + 0.3, report
    assert mlx_spec.load_drafter(dest, model) is not None


def test_feature_cache_runs_the_target_once_per_sequence_and_changes_nothing(target, tmp_path, monkeypatch):
    import mlx_spec.train.trainer as trainer

    _, model, tok = target
    calls = []
    real = trainer.target_batch
    monkeypatch.setattr(trainer, "target_batch", lambda *a: calls.append(1) or real(*a))
    kw = dict(prompts=PROMPTS, max_length=24, steps=8, lr=3e-3, ttt_steps=2, eval_tokens=4, **FAST)
    train_eagle3(model, tok, tmp_path / "kept", **kw)
    kept = len(calls)
    rows = len((tmp_path / "kept" / "data.jsonl").read_text().splitlines())
    train_eagle3(model, tok, tmp_path / "fresh", feature_cache_gb=0, **kw)
    assert (kept, len(calls) - kept) == (rows, 8)  # 2 epochs: once per sequence, or once per step
    a = mx.load(str(tmp_path / "kept" / "model.safetensors"))
    b = mx.load(str(tmp_path / "fresh" / "model.safetensors"))
    for k in a:
        np.testing.assert_array_equal(np.array(a[k]), np.array(b[k]), err_msg=k)


@pytest.mark.parametrize("layout", ["midlayer", "speculators"])
def test_exports_keep_the_heads_forward_options(target, tmp_path, layout):
    """A realigned published head keeps its options (`norm_before_residual`, `norm_output`,
    q/k/v biases); its export converts back to the same forward."""
    from mlx_spec.drafters.eagle import Eagle3Head
    from mlx_spec.train.export import head_config, write_head

    folder, model, _ = target
    cfg = {**head_config(model, [1, 2, 4], 32), "norm_before_residual": True, "norm_output": True,
           "attention_bias": True}
    mx.random.seed(1)
    write_head(tmp_path / "head", Eagle3Head(cfg), cfg, mx.arange(32, dtype=mx.int32) * 2)
    exported, back = tmp_path / "export", tmp_path / "back"
    assert cli_main(["train", "export", str(tmp_path / "head"), str(exported), "--layout", layout,
                     "--model", str(folder)]) == 0
    assert cli_main(["convert", "head", str(exported), str(back), "--target", str(folder)]) == 0
    got = json.loads((back / "config.json").read_text())
    assert {k: got[k] for k in ("norm_before_residual", "norm_output", "attention_bias")} == dict.fromkeys(
        ("norm_before_residual", "norm_output", "attention_bias"), True)
    a, b = mx.load(str(tmp_path / "head" / "model.safetensors")), mx.load(str(back / "model.safetensors"))
    for k in a:
        np.testing.assert_array_equal(np.array(a[k]), np.array(b[k]), err_msg=k)


def test_each_answer_runs_to_max_length_whatever_the_prompts_beside_it(target):
    """Answers are written in groups; the group's longest prompt used to set every row's budget."""
    from mlx_spec.train.data import answer

    _, model, tok = target
    prompts = [[5, 6, 7, 8, 9]] * 3 + [list(range(10, 50))]
    rows = answer(model, tok, prompts, 64, log=lambda m: None)  # this target has no EOS
    assert [len(r["tokens"]) for r in rows] == [64] * 4
    assert [r["prompt_len"] for r in rows] == [5, 5, 5, 40]


def test_a_head_over_the_whole_vocabulary_exports_and_converts_back(target, tmp_path):
    """Such a head has no draft_to_target (draft id i is target id i): export used to fail on it
    with a KeyError."""
    from converters.eagle import v3
    from eagle_fixtures import eagle3_checkpoint

    folder, model, _ = target
    eagle3_checkpoint(tmp_path / "src", 64, tiny.VOCAB, config={"eagle_aux_hidden_state_layer_ids": [2, 3, 5]})
    head = v3.convert(tmp_path / "src", tmp_path / "head", folder)
    assert "draft_to_target" not in mx.load(str(head / "model.safetensors"))
    assert cli_main(["train", "export", str(head), str(tmp_path / "x"), "--layout", "midlayer"]) == 0
    assert cli_main(["convert", "head", str(tmp_path / "x"), str(tmp_path / "back"), "--target", str(folder)]) == 0
    a, b = mx.load(str(head / "model.safetensors")), mx.load(str(tmp_path / "back" / "model.safetensors"))
    ids = b.pop("draft_to_target", mx.arange(tiny.VOCAB))  # the export's tables say: the identity
    assert set(a) == set(b) and np.array_equal(np.array(ids), np.arange(tiny.VOCAB))
    for k in a:
        np.testing.assert_array_equal(np.array(a[k]), np.array(b[k]), err_msg=k)
