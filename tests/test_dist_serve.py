"""`mlx-spec serve --shard` on 2 local ranks, and ranks that hang or cannot connect.

Every launch is a subprocess on 127.0.0.1 bounded by a timeout (`mlx-spec launch
--timeout`, and the waits here); every request is bounded too."""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import tiny
from server_utils import open_stream, post
from dist_checkpoints import save, v4_checkpoint
from test_distributed import _descendants

HERE = Path(__file__).parent
ENV = {**os.environ, "MLX_SPEC_CHECK_SYNC": "1", "PYTHONPATH": str(HERE)}
PROMPTS = ([5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [11, 3, 40, 41, 42, 11, 3, 40])
N = 16


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    ENV["MLX_SPEC_CACHE"] = str(tmp_path_factory.mktemp("rank_cache"))
    return save(tmp_path_factory.mktemp("dist_serve") / "llama",
                tiny.llama_model(seed=0, layers=4, heads=4, kv_heads=2))


class Launch:
    """`mlx-spec launch -n 2 ... -- COMMAND` in its own process group, output collected."""

    def __init__(self, *command, timeout=150):
        cmd = [sys.executable, "-m", "mlx_spec", "launch", "-n", "2", "--timeout", str(timeout),
               "--", *map(str, command)]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=ENV,
                                     start_new_session=True)
        self.out, self.err = [], []
        self.readers = [threading.Thread(target=self._read, args=(s, b), daemon=True)
                        for s, b in ((self.proc.stdout, self.out), (self.proc.stderr, self.err))]
        for t in self.readers:
            t.start()

    @staticmethod
    def _read(stream, into):  # as it comes (generate prints tokens without newlines)
        for chunk in iter(lambda: os.read(stream.fileno(), 4096), b""):
            into.append(chunk.decode(errors="replace"))

    def wait_for(self, pattern, timeout):
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            m = re.search(pattern, "".join(self.out))
            if m:
                return m
            assert self.proc.poll() is None, "".join(self.err)[-3000:]
            time.sleep(0.2)
        raise AssertionError(f"no {pattern!r} within {timeout} s: {''.join(self.err)[-3000:]}")

    def rank_pid(self, rank: int, what: bytes, timeout=30) -> int:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            for pid in _descendants(self.proc.pid):
                try:
                    env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
                    cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
                except OSError:
                    continue
                if f"MLX_RANK={rank}".encode() in env and what in cmd and b"mlx.launch" not in cmd:
                    return pid
            time.sleep(0.2)
        raise AssertionError(f"rank {rank} did not start")

    def finish(self, timeout):
        self.proc.wait(timeout=timeout)
        for t in self.readers:
            t.join(5)
        return "".join(self.out), "".join(self.err)

    def kill(self):
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)


def unsharded(folder) -> list[str]:
    import mlx_spec

    model, tok = mlx_spec.load(str(folder))
    return [mlx_spec.generate(model, tok, p, None, max_tokens=N) for p in PROMPTS]


# auto: the draft lengths are rank 0's, and the batch policy's curves are measured by all
# ranks in the warm-up (a rank measuring alone, later, would run forwards the others do not)
@pytest.mark.parametrize("mode,k,branches", [("pipeline", "3", "1"), ("tensor", "auto", "2")])
def test_sharded_serve_matches_unsharded(folder, mode, k, branches):
    want = unsharded(folder)
    run = Launch("serve", "--shard", mode, "--model", folder, "--port", "0", "--draft", "ngram",
                 "--num-draft-tokens", k, "--max-batch", "2", "--dist-timeout", "120",
                 "--branches", branches, timeout=400)
    try:
        port = int(run.wait_for(r"at http://127\.0\.0\.1:(\d+)/v1", 240).group(1))
        body = {"model": str(folder), "max_tokens": N, "temperature": 0}
        plain = {}

        def ask():  # decoded in one batch with the streamed request below
            plain["r"] = post(port, "/v1/completions", {**body, "prompt": PROMPTS[0]}, timeout=120)

        asker = threading.Thread(target=ask)
        asker.start()
        conn, resp = open_stream(port, "/v1/completions", {**body, "prompt": PROMPTS[1], "stream": True},
                                 timeout=120)
        chunks = [json.loads(line[6:]) for line in resp.read().decode().splitlines()
                  if line.startswith("data: {")]
        conn.close()
        asker.join(120)
        status, out = plain["r"]
        assert status == 200 and out["choices"][0]["text"] == want[0], out
        assert out["speculative"]["drafter"] == "ngram"
        assert "".join(c["choices"][0]["text"] for c in chunks) == want[1]
        # The prompt cache (each rank holds its own layers' part), sampling with a seed rank 0
        # draws, and logits processors rebuilt on rank 1: ranks stay in step (sync check on).
        status, again = post(port, "/v1/completions", {**body, "prompt": PROMPTS[0] + [3]}, timeout=120)
        assert status == 200 and again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        status, sampled = post(port, "/v1/completions", {**body, "prompt": PROMPTS[1], "temperature": 1.0,
                                                         "logit_bias": {"26": -5}}, timeout=120)
        assert status == 200 and sampled["usage"]["completion_tokens"] > 0, sampled
        status, out = post(port, "/v1/completions", {**body, "prompt": PROMPTS[0]}, timeout=120)
        assert status == 200 and out["choices"][0]["text"] == want[0]
        os.kill(run.rank_pid(0, b"serve"), signal.SIGTERM)  # shutting rank 0 down ends every rank
        stdout, stderr = run.finish(timeout=90)
        assert run.proc.returncode == 0, stderr[-3000:]
        assert "mlx-spec serve: stopped" in stdout
        assert f"{mode} parallel over 2 ranks" in stderr
        assert not _descendants(run.proc.pid)
    finally:
        run.kill()


def test_sharded_v4_serve_matches_unsharded(folder, tmp_path):
    """DeepSeek-V4 (mlx-vlm's model) served on a pipeline split with its DSpark stages (random:
    every proposal is rejected, so every step rolls back): greedy text equals the unsharded
    target's. The engine thread evaluates what the loading thread built (MLX streams are per
    thread; mlx-vlm's RoPE frequencies are lazy). One request at a time keeps the start short
    (no batched verify calibration)."""
    import mlx_spec

    v4 = v4_checkpoint(tmp_path / "v4")
    model, tok = mlx_spec.load(str(v4))
    want = mlx_spec.generate(model, tok, PROMPTS[0], None, max_tokens=24)
    run = Launch("serve", "--shard", "pipeline", "--model", v4, "--port", "0", "--draft", "dspark",
                 "--num-draft-tokens", "6", "--max-batch", "1", "--dist-timeout", "60", timeout=240)
    try:
        port = int(run.wait_for(r"at http://127\.0\.0\.1:(\d+)/v1", 150).group(1))
        status, out = post(port, "/v1/completions", {"model": str(v4), "prompt": PROMPTS[0],
                                                     "max_tokens": 24, "temperature": 0}, timeout=120)
        assert status == 200 and out["choices"][0]["text"] == want, out
        assert out["speculative"]["drafter"] == "dspark" and out["speculative"]["drafted"] > 0
        os.kill(run.rank_pid(0, b"serve"), signal.SIGTERM)
        stdout, stderr = run.finish(timeout=90)
        assert run.proc.returncode == 0, stderr[-3000:]
        assert "pipeline parallel over 2 ranks" in stderr and "mlx-spec serve: stopped" in stdout
    finally:
        run.kill()


def _end(pid: int | None) -> None:
    """A rank the test stopped: let it go and kill it."""
    if pid is not None:
        try:
            os.kill(pid, signal.SIGCONT)
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_a_hung_rank_ends_the_launch(folder):
    """Rank 1 stops (SIGSTOP: alive, silent). Rank 0, blocked in a forward, gives up after
    --dist-timeout naming itself and the forward; the launch ends every rank."""
    run = Launch("generate", "--shard", "pipeline", "--model", folder, "--prompt", "w5 w6 w7 w8 w5 w6",
                 "--ignore-chat-template", "--verbose", "False", "--max-tokens", "1000000",
                 "--num-draft-tokens", "2", "--dist-timeout", "8", timeout=300)  # (4 s tripped on a loaded machine)
    victim = None
    try:
        run.wait_for(r"w\d+ w\d+ w\d+", 180)  # decoding
        victim = run.rank_pid(1, b"generate")
        os.kill(victim, signal.SIGSTOP)
        tic = time.monotonic()
        _, stderr = run.finish(timeout=60)
        took = time.monotonic() - tic
        assert run.proc.returncode == 1, stderr[-3000:]
        assert re.search(r"error: rank 0 made no progress for 8 s at target forward \d+", stderr), stderr[-3000:]
        assert "error: rank 0 ended with exit code 1" in stderr
        assert took < 8 + 10 + 40  # the limit, launch's grace for the stopped rank, slack
        assert not _descendants(run.proc.pid)
    finally:
        _end(victim)
        run.kill()


def test_a_hung_rank_ends_an_idle_sharded_server(folder):
    """An idle rank 0 still sends an empty plan every second: with rank 1 stopped, rank 0
    gives up at that message."""
    run = Launch("serve", "--shard", "pipeline", "--model", folder, "--port", "0",
                 "--num-draft-tokens", "3", "--dist-timeout", "3", timeout=300)
    victim = None
    try:
        run.wait_for(r"at http://127\.0\.0\.1:\d+/v1", 180)
        victim = run.rank_pid(1, b"serve")
        os.kill(victim, signal.SIGSTOP)
        _, stderr = run.finish(timeout=60)
        assert run.proc.returncode == 1, stderr[-3000:]
        assert re.search(r"error: rank 0 made no progress for 3 s at server step \d+", stderr), stderr[-3000:]
        assert not _descendants(run.proc.pid)
    finally:
        _end(victim)
        run.kill()


def test_a_rank_that_cannot_connect_ends_with_an_error(folder, tmp_path):
    """Rank 0 of 2 started alone, its peer's port unused: MLX's ring backend would retry
    forever; --dist-timeout ends it with an error."""
    ports = []
    for _ in range(2):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])
    hosts = tmp_path / "hosts.json"
    hosts.write_text(json.dumps([[f"127.0.0.1:{p}"] for p in ports]))
    cmd = [sys.executable, "-m", "mlx_spec", "generate", "--shard", "pipeline", "--model", str(folder),
           "--prompt", "w5 w6", "--ignore-chat-template", "--dist-timeout", "3"]
    tic = time.monotonic()
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120,
                          env={**ENV, "MLX_RANK": "0", "MLX_HOSTFILE": str(hosts)})
    assert done.returncode == -signal.SIGTERM, done.stderr[-3000:]  # ended by the watching helper
    assert "error: rank 0 made no progress for 3 s at connecting to the other ranks" in done.stderr
    assert time.monotonic() - tic < 90  # imports and loading, then 3 s


def test_a_launch_on_a_port_in_use_ends_with_an_error(folder):
    """mlx-spec launch whose first ring port is taken: rank 0 cannot listen, says so, and
    the launch ends every rank at once."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        cmd = [sys.executable, "-m", "mlx_spec", "launch", "-n", "2", "--starting-port", str(port),
               "--timeout", "100", "--", "generate", "--shard", "pipeline", "--model", str(folder),
               "--prompt", "w5 w6", "--ignore-chat-template", "--dist-timeout", "20"]
        tic = time.monotonic()
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=ENV)
    assert done.returncode == 1, done.stderr[-3000:]
    assert "error: rank 0 could not join the other ranks: [ring] Couldn't bind socket" in done.stderr
    assert "error: rank 0 ended with exit code 2" in done.stderr
    assert time.monotonic() - tic < 90  # before loading anything

