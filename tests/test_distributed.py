"""A target sharded over local ranks (`mx.distributed`, ring backend on 127.0.0.1).

Every launch is a subprocess bounded by a timeout. One launch per setup runs
every check (`tests/dist_worker.py`), since starting ranks costs seconds."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import mlx.core as mx
import pytest

import mtp_checkpoints
import tiny
from dist_checkpoints import dflash_head, eagle3_head, save, v4_checkpoint
from mlx_spec import distributed
from mlx_spec.launch import quiet_stdin

HERE = Path(__file__).parent
WORKER = HERE / "dist_worker.py"
LAUNCH = Path(sys.executable).parent / "mlx.launch"
ENV = {**os.environ, "MLX_SPEC_CHECK_SYNC": "1", "PYTHONPATH": str(HERE)}


@pytest.fixture(autouse=True, scope="module")
def _ranks_calibration_cache(tmp_path_factory):
    """The ranks (other processes) keep their calibrations of tiny models out of ~/.cache."""
    ENV["MLX_SPEC_CACHE"] = str(tmp_path_factory.mktemp("rank_cache"))


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("dist")
    out = {
        "llama": save(root / "llama", tiny.llama_model(seed=0, layers=4, heads=4, kv_heads=2)),
        "draft": save(root / "draft", tiny.llama_model(seed=1, layers=1)),
        "qwen2": save(root / "qwen2", tiny.qwen2_model(seed=3, layers=4)),
        "qwen2_draft": save(root / "qwen2_draft", tiny.qwen2_model(seed=4, layers=1)),
        "llama_hd32": save(root / "llama_hd32", tiny.llama_model(seed=0, layers=4, heads=2, kv_heads=2)),
        "qwen3_5": save(root / "qwen3_5", tiny.qwen3_5_model(layers=4)),  # recurrent layers
        # window 8, sliding/global alternating: rank 1's layers 3..4 start on a global layer
        "gemma3": save(root / "gemma3", tiny.gemma3_model(seed=5, layers=5)),
        "v4": v4_checkpoint(root / "v4"),  # mlx-vlm's deepseek_v4 (the test extra installs it)
        # GLM-4.7-Flash layout with its MTP module: mlx-lm's pipeline() and shard(), 1 layer a rank
        "glm_mtp": mtp_checkpoints.write(root / "glm_mtp", "glm4_moe_lite"),
    }
    out["llama_head"], out["qwen2_head"] = (eagle3_head(root, out[t]) for t in ("llama", "qwen2"))
    out["llama_dflash"] = dflash_head(root, out["llama"])
    return out


def launch(n, *args, timeout=180, env=None):
    """`mlx.launch` of `n` ranks, in a session of its own: on a timeout every rank is killed
    with it (killing mlx.launch alone leaves the ranks running, spinning in the ring
    backend and slowing every later test), and the timeout is reported with their output."""
    cmd = [str(LAUNCH), "-n", str(n), "--backend", "ring", "--", sys.executable, *map(str, args)]
    proc = subprocess.Popen(cmd, env=env or ENV, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    quiet_stdin(proc)  # (else mlx.launch spins a core's worth while the ranks run)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(f"the launch of {n} ranks did not end in {timeout} s; its stderr:\n"
                             f"{err[-3000:]}") from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


SETUPS = {  # ranks -> [(mode, target, draft, suffix)]: one launch each
    2: [("pipeline", "llama", "draft", ""),  # our stage wrappers
        ("tensor", "llama", "draft", ":noauto"),  # mlx-lm's shard()
        ("pipeline", "qwen2", "qwen2_draft", ":noauto"),  # mlx-lm's pipeline()
        ("pipeline", "gemma3", "draft", ":quick"),  # our stage wrappers, per-layer masks
        ("pipeline", "llama", "llama_head", ":head"),  # EAGLE-3 taps across our stages
        ("pipeline", "llama", "llama_dflash", ":head:quick"),  # a DFlash block drafter's taps
        ("pipeline", "qwen2", "qwen2_head", ":head:quick"),  # ... across mlx-lm's stages
        ("pipeline", "v4", "v4", ":v4"),  # DeepSeek-V4 + its DSpark stages: mlx-vlm's forward
        ("tensor", "v4", "v4", ":v4"),  # mlx-vlm's shard()
        ("pipeline", "glm_mtp", "glm_mtp", ":mtp"),  # an MTP head reading the last stage's state
        ("tensor", "glm_mtp", "glm_mtp", ":mtp")],
    3: [("pipeline", "llama", "draft", ":quick"),  # 3 ranks on 2 cores are slow: fewer runs
        ("pipeline", "llama", "llama_head", ":head:quick")],
}
SLOW = bool(os.environ.get("MLX_SPEC_DIST_SLOW"))  # the checks that take minutes here
if SLOW:  # mlx-lm's pipeline() on a hybrid target: rollback by snapshot + replay
    SETUPS[2].append(("pipeline", "qwen3_5", "draft", ":quick:noauto"))


@pytest.mark.parametrize("n", sorted(SETUPS))
def test_sharded_runs_match(folders, tmp_path, n):
    setups = [f"{mode}:{folders[t]}:{folders[d]}{suffix}" for mode, t, d, suffix in SETUPS[n]]
    done = launch(n, WORKER, tmp_path, *setups)
    files = [tmp_path / f"rank{r}.json" for r in range(n)]
    assert all(f.exists() for f in files), done.stderr[-3000:]  # (mlx.launch exits 0 anyway)
    ranks = [json.loads(f.read_text()) for f in files]
    for other in ranks[1:]:  # every run (sampled ones too) is the same on every rank
        assert other == ranks[0]
    for setup in setups:
        res, mode = ranks[0][setup], setup.split(":")[0]
        assert f"over {n} ranks" in res["layout"]
        if ":head" in setup:
            _check_head_runs(res, setup)
            continue
        if ":v4" in setup:
            _check_v4_runs(res, setup)
            continue
        if ":mtp" in setup:
            _check_mtp_runs(res, setup)
            continue
        for i in range(1 if ":quick" in setup else 2):
            plain = res[f"plain{i}"]
            # Splitting layers changes no arithmetic: bit for bit the unsharded model. Tensor
            # parallel sums partial products in another order; these tiny models keep the argmax.
            assert plain == res[f"unsharded{i}"], setup
            for kind in ("ngram", "ngram_auto", "draft_model"):
                assert res.get(f"{kind}{i}", plain) == plain, (setup, kind)
            if f"tree_auto{i}" in res:  # the shape rank 0's (sync check on)
                assert res[f"tree_auto{i}"][0] == plain, setup
            if f"ahead_auto{i}" in res:  # plain steps queued ahead alike on every rank
                ahead, drafted, forwards = res[f"ahead_auto{i}"]
                assert ahead == plain and 0 < drafted < forwards, setup  # drafts and plain steps ran
            if mode == "pipeline":  # identical logits: identical seeded sampling too
                for seed in (1,) if ":quick" in setup else (1, 2):
                    assert res[f"sampled{i}_{seed}"] == res[f"sampled_unsharded{i}_{seed}"], setup
        if "tree_auto1" in res:  # whole trees were verified
            assert res["tree_auto0"][1] + res["tree_auto1"][1] > 0, setup
        if "cache_turns" in res:  # turn 2 continues from the sharded prompt cache
            seen, turn2, whole_history = res["cache_turns"]
            assert turn2 == whole_history and res["cache_turns"] == res["cache_turns_unsharded"]


def _check_head_runs(res: dict, setup: str) -> None:
    """A head reading layer taps on a pipeline split: the same tokens and the same proposal
    at every step as on the unsharded target (so the same taps), greedy and seeded sampled;
    greedy tokens are plain decoding's."""
    for i in range(1 if ":quick" in setup else 2):
        assert res[f"plain{i}"] == res[f"unsharded{i}"], setup
        assert res[f"head{i}_None"][0] == res[f"plain{i}"], setup
        runs = [k for k in res if k.startswith(f"head{i}_")]
        assert len(runs) == (1 if ":quick" in setup else 2)
        for key in runs:
            assert res[key] == res[key.replace("head", "head_unsharded")], (setup, key)
            assert res[key][1], (setup, key)  # steps with proposals were traced


def _check_v4_runs(res: dict, setup: str) -> None:
    """DeepSeek-V4 (mlx-vlm) with the DSpark stages of its checkpoint, whose taps (layers 1..3)
    sit on both pipeline stages; 12 drafts, so verify blocks of 13 go in pieces of 8: plain
    output equals the unsharded target's, n-gram and DSpark output equal plain decoding, and
    every DSpark proposal equals the unsharded run's (so the taps are the same); on the
    pipeline split seeded sampled n-gram output equals the unsharded run's."""
    assert res["plain0"] == res["unsharded0"], setup
    assert res["ngram0"] == res["plain0"] == res["dspark"][0], setup
    assert res["dspark"] == res["dspark_unsharded"], setup
    assert any(len(proposed) == 12 for proposed, _ in res["dspark"][1]), setup  # pieces
    if setup.startswith("pipeline"):  # identical logits: identical seeded sampling too
        assert res["sampled0_1"] == res["sampled_unsharded0_1"], setup


def _check_mtp_runs(res: dict, setup: str) -> None:
    """The target's MTP module: plain output equals the unsharded target's, greedy MTP output
    (the head reading the final-norm input, or the last layer's output) equals plain decoding,
    and every run (greedy and seeded sampled: its tokens and each step's proposal) equals the
    unsharded run's, so the head read the same hidden states."""
    assert res["plain0"] == res["unsharded0"], setup
    assert res["mtp_None"][0] == res["plain0"], setup
    for run, unsharded in (("mtp_None", "mtp_unsharded_None"), ("mtp_1", "mtp_unsharded_1"),
                           ("mtp_last", "mtp_last_unsharded")):
        assert res[run] == res[unsharded], (setup, run)
    assert res["mtp_last"][0] == res["plain0"], setup
    # the whole model's last layer on every rank (not a pipeline rank's own last layer)
    assert res["mtp_last_taps"] == res["mtp_last_unsharded_taps"], setup
    assert sum(accepted for _, accepted in res["mtp_None"][1]) > 0, setup  # it drafted, and some held


def test_sampled_law_on_a_tensor_split(tmp_path):
    """The chi-square harness's draft-model case (temperature 1) on a 2-rank tensor split:
    every rank draws the same tokens, and their law is the unsharded target's. 300 runs by
    default (its power against wrong rules is shown on one process, tests/lossless.py);
    MLX_SPEC_DIST_SLOW=1 runs 1500 (about 4 minutes on 2 cores)."""
    import numpy as np
    from lossless import Runs, assert_lossless, exact_joint, v8_llama

    runs = 1500 if SLOW else 300
    done = launch(2, WORKER, tmp_path, "lossless", runs, timeout=600,
                  env={**ENV, "MLX_SPEC_CHECK_SYNC": "0"})
    files = [tmp_path / f"rank{r}.json" for r in range(2)]
    assert all(f.exists() for f in files), done.stderr[-3000:]
    ranks = [json.loads(f.read_text()) for f in files]
    assert ranks[0] == ranks[1]
    assert ranks[0]["deep_first_steps"] > 0.9 * runs
    joint = exact_joint(v8_llama(), [1, 2, 3, 1, 2], 5, dict(temp=1.0), vocab=8)
    tokens = np.array(ranks[0]["tokens"])
    assert_lossless(Runs(tokens, [None] * runs, [None] * runs, 8), joint)


def test_sync_check_fires_on_a_desynchronised_rank(folders, tmp_path):
    tic = time.monotonic()
    done = launch(2, WORKER, tmp_path, f"pipeline:{folders['llama']}:{folders['draft']}", "desync")
    assert "DesyncError: rank 1 is out of step with rank 0 at target forward" in done.stderr
    assert time.monotonic() - tic < 60


def _cli(folder, *extra):
    return [sys.executable, "-m", "mlx_spec", *extra, "--model", str(folder), "--prompt",
            "w5 w6 w7 w8 w5 w6 w7 w1 w2 w3 w4 w5 w6", "--ignore-chat-template", "--verbose", "False", "--temp", "0"]


def test_launch_generate_matches_unsharded(folders):
    # A quantized KV cache (head_dim 32 for group size 32) and a prompt in chunks of 4.
    options = ["--max-tokens", "16", "--kv-bits", "8", "--quantized-kv-start", "0",
               "--kv-group-size", "32", "--prefill-step-size", "4"]
    one = subprocess.run(_cli(folders["llama_hd32"], "generate", *options),
                         capture_output=True, text=True, timeout=60, env=ENV)
    assert one.returncode == 0, one.stderr
    cmd = _cli(folders["llama_hd32"], "launch", "-n", "2", "--timeout", "60", "--", "generate",
               "--shard", "pipeline", *options)
    two = subprocess.run(cmd, capture_output=True, text=True, timeout=90, env=ENV)
    assert two.returncode == 0, two.stderr
    assert two.stdout == one.stdout  # rank 0 prints, the other rank is silent
    assert "rank 1: layers 2..3 of 4" in two.stderr


def test_launch_bench_sharded(folders, tmp_path):
    cmd = [sys.executable, "-m", "mlx_spec", "launch", "-n", "2", "--timeout", "80", "--", "bench",
           "--shard", "tensor", "--model", str(folders["llama"]), "--methods", "ngram",
           "--num-draft-tokens", "3", "--max-tokens", "12", "--suites", "code-edit",
           "--cost-repeats", "0", "--out", str(tmp_path)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=100, env=ENV)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((tmp_path / "results.json").read_text())  # written by rank 0 alone
    assert all(v["identical"] == v["runs"] == 1 for v in result["identical"].values())
    assert "tensor parallel over 2 ranks" in done.stderr


def test_killing_a_rank_ends_every_rank(folders):
    cmd = _cli(folders["llama"], "launch", "-n", "2", "--timeout", "60", "--", "generate",
               "--shard", "pipeline", "--max-tokens", "1000000", "--num-draft-tokens", "2")
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env=ENV, start_new_session=True)
    try:
        victim = _wait_for_rank(proc.pid, rank=1, timeout=30)
        time.sleep(1.0)  # decoding
        os.kill(victim, signal.SIGKILL)
        tic = time.monotonic()
        _, err = proc.communicate(timeout=45)
        assert time.monotonic() - tic < 45
        assert proc.returncode == 1, err[-2000:]
        assert "error: rank 1 ended with signal 9" in err
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def _wait_for_rank(root: int, rank: int, timeout: float) -> int:
    """The pid of the process under `root` that runs mlx_spec generate as `rank`."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        for pid in _descendants(root):
            try:
                env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue
            if f"MLX_RANK={rank}".encode() in env and b"generate" in cmd and b"mlx.launch" not in cmd:
                return pid
        time.sleep(0.2)
    raise AssertionError(f"rank {rank} did not start")


def _descendants(root: int) -> list[int]:
    children = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


class FakeGroup:
    def __init__(self, size, rank=0):
        self._size, self._rank = size, rank

    def size(self):
        return self._size

    def rank(self):
        return self._rank


def test_clear_errors_before_any_message():
    with pytest.raises(ValueError, match="not divisible by 3 ranks"):
        distributed.shard_model(tiny.llama_model(layers=4, heads=4, kv_heads=2), "tensor", FakeGroup(3))
    with pytest.raises(ValueError, match="5 ranks but the model has only 4 layers"):
        distributed.shard_model(tiny.llama_model(layers=4), "pipeline", FakeGroup(5))
    other = tiny.llama_model(layers=4)
    other.args.model_type = "olmo"  # a family with neither mlx-lm's pipeline() nor our stages
    with pytest.raises(ValueError, match="'olmo' cannot be split into pipeline stages"):
        distributed.shard_model(other, "pipeline", FakeGroup(2))
    with pytest.raises(ValueError, match="'gemma3_text' has no tensor-parallel shard"):
        distributed.shard_model(tiny.gemma3_model(layers=4), "tensor", FakeGroup(2))


def test_layer_split():
    assert [distributed._split(4, 3, r) for r in range(3)] == [(0, 2), (2, 3), (3, 4)]
    assert [distributed._split(30, 4, r) for r in range(4)] == [(0, 8), (8, 16), (16, 23), (23, 30)]


def test_layer_taps_on_pipeline_stages():
    """Rank 1 of 2 (layers 2..3): it records the taps of its own layers, inside the stage
    wrappers (whose input or output is another rank's), and gathers the others'."""
    from mlx_spec.distributed import _Receive, _SendOn
    from mlx_spec.taps import EMBED, FINAL_NORM, Taps, _Recorder

    model = tiny.llama_model(layers=4)
    distributed.shard_model(model, "pipeline", FakeGroup(2, rank=1))  # builds wrappers only
    shard = distributed.shard_of(model)
    assert shard.layers == (2, 4) and len(model.layers) == 2
    with pytest.raises(ValueError, match="this target has 4 decoder layers"):
        Taps(model, [4])
    taps = Taps(model, [EMBED, 1, 3, 2, 2, FINAL_NORM])
    first, last = model.model.layers
    assert isinstance(first, _Receive) and isinstance(first.inner, _Recorder)
    assert isinstance(last, _SendOn) and isinstance(last.inner, _Recorder)
    # the order asked for (the same on every rank), each id once; recorded here: 3 and 2
    assert [(t, src is not None) for t, _, src in shard.taps.entries] == [
        (EMBED, False), (1, False), (3, True), (2, True)]
    taps.remove()
    assert not shard.taps.entries and not isinstance(first.inner, _Recorder)
    assert not isinstance(last.inner, _Recorder)
    shard.taps = None  # (an mlx-lm pipeline() family without a final norm to gather at)
    with pytest.raises(ValueError, match="no final norm to gather them at"):
        Taps(model, [1])
    Taps(model, [FINAL_NORM]).remove()  # computed on every rank


def test_gemma3_stage_layers_keep_their_kind():
    """Rank 1 of 2 holds gemma3 layers 3..4 (global, sliding): its caches and masks follow
    the layers' own kind, not their positions 0, 1 in its list."""
    from mlx_lm.models.cache import KVCache, RotatingKVCache

    model = tiny.gemma3_model(layers=5, window=8)
    distributed.shard_model(model, "pipeline", FakeGroup(2, rank=1))
    assert distributed.shard_of(model).layers == (3, 5)
    assert [type(c) for c in model.make_cache()] == [KVCache, RotatingKVCache]
    assert [layer.window() for layer in model.model.layers] == [None, 8]
    model.model.window_size = 4  # read when used, like the model's own mask
    assert model.make_cache()[1].max_size == 4 and model.model.layers[1].window() == 4


def _real_gemma3_pipeline_matches_unsharded(tmp_path):
    """gemma-3-270m (float32) over 2 ranks (layers 0..8 and 9..17: rank 1's list starts at a
    sliding layer in the middle of the 6-layer pattern), its 512-token window cut to 16,
    which the 19-token prompt already crosses: plain and n-gram greedy tokens (24) equal
    the unsharded model's. 2.5-4 minutes on this loaded 2-core machine (loading 1.1 GB
    per rank is much of it), so only with MLX_SPEC_DIST_SLOW=1."""
    from mlx_lm.generate import generate_step

    import mlx_spec
    from mlx_spec import zoo

    folder = zoo.fetch("gemma-3-270m", dtype="float32")
    texts = ["Repeat exactly: the quick brown fox jumps over the lazy dog. the quick brown fox."]
    done = launch(2, WORKER, tmp_path, "real", folder, 16, 24, *texts, timeout=400)
    files = [tmp_path / f"rank{r}.json" for r in range(2)]
    assert all(f.exists() for f in files), done.stderr[-3000:]
    ranks = [json.loads(f.read_text()) for f in files]
    assert ranks[0] == ranks[1] and "rank 1: layers 9..17 of 18" in ranks[0]["layout"]
    model, tok = mlx_spec.load(str(folder))
    model.args.sliding_window = model.model.window_size = 16
    for i, text in enumerate(texts):
        ids = tok.encode(text)
        assert len(ids) > 16
        want = [int(t) for t, _ in generate_step(mx.array(ids), model, max_tokens=24)]
        assert ranks[0][f"plain{i}"] == want, (i, tok.decode(want), tok.decode(ranks[0][f"plain{i}"]))
        assert ranks[0][f"ngram{i}"] == want, i


if SLOW:  # minutes here; the tiny gemma3 of test_sharded_runs_match covers stage positions always
    test_real_gemma3_pipeline_matches_unsharded = pytest.mark.download(
        pytest.mark.slow(_real_gemma3_pipeline_matches_unsharded))


def test_ranks_holding_different_models_are_refused_by_name(folders, tmp_path):
    """Each Mac may hold its own copy of the model: a rank with another one used to run on with
    ranks disagreeing on every token, until the timeout."""
    script = tmp_path / "other_model_on_rank_1.py"
    script.write_text(
        "import os, sys\nfrom mlx_spec.cli import main\nargv = sys.argv[1:]\n"
        f"if os.environ.get('MLX_RANK') == '1':\n    argv[argv.index('--model') + 1] = {str(folders['llama_hd32'])!r}\n"
        "sys.exit(main(argv))\n")
    done = launch(2, script, "generate", "--shard", "pipeline", "--model", folders["llama"], "--prompt", "w5 w6",
                  "--ignore-chat-template", "--max-tokens", "4", timeout=120)
    assert "exited with code 2" in done.stderr  # (mlx.launch itself exits 0: `mlx-spec launch` reads this)
    assert "rank 1 loaded a model of another configuration than rank 0's" in done.stderr, done.stderr[-2000:]


def test_mlx_launch_does_not_spin_while_its_ranks_run():
    """mlx.launch's thread for each rank waits for the rank's stdin to become writable; with a
    pipe nobody reads (or /dev/null) it spun: 2 ranks sleeping 6 s cost it 8 CPU-seconds,
    half in the kernel, a core taken from the ranks on a 2-core machine."""
    import resource

    cmd = [str(LAUNCH), "-n", "2", "--backend", "ring", "--",
           sys.executable, "-c", "import time; time.sleep(4)"]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)
    quiet_stdin(proc)
    out, err = proc.communicate(timeout=60)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    used = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
    assert proc.returncode == 0, err[-2000:]
    assert used < 1.5, f"{used:.1f} CPU-seconds for two ranks that sleep 4 s"
