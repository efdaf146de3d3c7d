"""Decoding with a key-value cache (:mod:`mpitrain.nn.kv_cache`) against recomputation, and
``mpitrain sample``'s figures (:mod:`mpitrain.train.sampling`); over MPI ranks:
``tests/test_mpi_trained.py``."""

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from test_trained import gpt_run  # noqa: F401 (a fixture)

from mpitrain import cli, cost, rng
from mpitrain.nn import kv_cache
from mpitrain.nn.models import GPT, GPTConfig
from mpitrain.tensor import default_dtype
from mpitrain.train import sampling

PROMPTS = [np.arange(1, 9) % 65, np.arange(3, 40) % 65, np.array([5])]  # three lengths: a ragged batch


def model(dtype=np.float32, block_size=256, seed=0, **shape):
    with default_dtype(dtype):
        rng.manual_seed(seed)
        m = GPT(GPTConfig(**{"vocab_size": 65, "block_size": block_size, "n_layer": 2, "n_head": 4, "n_embd": 32,
                             **shape}))
    return m.eval()


@pytest.mark.parametrize("dtype, tolerance", [(np.float32, 1e-6), (np.float64, 1e-13)])
def test_cached_logits_are_recomputations_for_200_tokens_of_a_ragged_batch(dtype, tolerance):
    """Each step's logits from the cache against the whole window through the model again,
    relative to the largest logit; each draws its token from a stream of its own seeded
    alike, and every token drawn is the same; the loop of :func:`sampling.generate` too."""
    m = model(dtype)
    cached, again = ([list(map(int, p)) for p in PROMPTS] for _ in range(2))
    streams = sampling.streams(1, range(3)), sampling.streams(1, range(3))
    kv = kv_cache.KVCache.for_model(m, len(PROMPTS), 256)
    worst = 0.0
    for n in range(200):
        logits = (kv_cache.prefill(m, *kv_cache.windows(cached, 256), kv) if n == 0
                  else kv_cache.next_logits(m, cached, kv, 256))
        whole = sampling.recomputed(m, again, 256)
        assert logits.dtype == whole.dtype == dtype
        worst = max(worst, np.abs(logits - whole).max() / np.abs(whole).max())
        for seqs, z, gens in ((cached, logits, streams[0]), (again, whole, streams[1])):
            for s, t in zip(seqs, sampling.draw(z, 0.8, None, gens)):
                s.append(int(t))
    assert worst <= tolerance and cached == again
    assert sampling.generate(m, PROMPTS, 200, block_size=256, seed=1).sequences == cached


def test_a_sequence_draws_the_same_alone_or_in_a_batch():
    """Its own stream, its own positions: the batch's padding and neighbours change nothing."""
    m = model()
    batch = sampling.generate(m, PROMPTS, 40, block_size=256, seed=7)
    for i, prompt in enumerate(PROMPTS):
        alone = sampling.generate(m, [prompt], 40, block_size=256, seed=7, first=i)
        assert alone.sequences[0] == batch.sequences[i]


def test_past_the_context_the_window_slides_as_recomputations_does():
    """A GPT of 16 positions drawing 50 tokens: from the 16th on, each token a prefill of the
    last 16 (a cache cannot shift its keys' positions), the same tokens as recomputation."""
    m = model(block_size=16)
    drawn = sampling.generate(m, PROMPTS, 50, block_size=16, seed=3)
    assert drawn.sequences == sampling.generate(m, PROMPTS, 50, block_size=16, seed=3, cache=False).sequences
    assert drawn.capacity == 16 and drawn.cache_bytes == cost.kv_cache_bytes(2, 3, 16, 32, 4)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_the_caches_bytes_are_the_formula(dtype):
    m = model(dtype, n_layer=3, n_embd=48)
    drawn = sampling.generate(m, PROMPTS, 10, block_size=256)
    context = max(len(p) for p in PROMPTS) + 10
    assert drawn.capacity == context
    assert drawn.cache_bytes == 2 * 3 * 3 * context * 48 * np.dtype(dtype).itemsize
    assert drawn.cache_bytes == cost.kv_cache_bytes(3, 3, context, 48, np.dtype(dtype).itemsize)


def test_a_stop_ends_the_loop_with_what_it_has():
    m = model()
    steps = []
    drawn = sampling.generate(m, PROMPTS, 100, block_size=256, stop=lambda: len(steps) >= 5,
                              progress=lambda done, total: steps.append(done))
    assert drawn.stopped and drawn.new_tokens == 6 and len(drawn.steps) == 5 and steps == [2, 3, 4, 5, 6]


def test_sample_prints_the_text_and_its_figures_and_json_holds_them(gpt_run, tmp_path, capsys):  # noqa: F811
    assert cli.main(["sample", str(gpt_run), "--prompt", "to be", "--tokens", "30", "--seed", "5"]) == 0
    out, err = capsys.readouterr()
    lines = err.splitlines()
    assert lines[0].startswith("(") and lines[0].endswith(", 1 rank(s))")  # the checkpoint drawn from
    lines = lines[1:]
    assert lines[0].startswith("time to first token: ") and "(the prefill of 1 prompt(s) of 5-5 tokens" in lines[0]
    assert lines[1].startswith("time per output token: mean ") and "(over 29 step(s) of 1 sequence(s))" in lines[1]
    assert lines[2].startswith("tokens/s: ") and lines[3].startswith("KV cache: ") and "peak memory" in lines[3]
    assert cli.main(["sample", str(gpt_run), "--prompt", "to be", "--tokens", "30", "--seed", "5", "--no-cache"]) == 0
    assert capsys.readouterr().out == out  # recomputation: the same text
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("to be\nor not to\nthe\n")
    assert cli.main(["sample", str(gpt_run), "--prompt-file", str(prompts), "--tokens", "12", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert [t[: len(p)] for t, p in zip(got["texts"], ["to be", "or not to", "the"])] == ["to be", "or not to", "the"]
    assert [len(t) for t in got["texts"]] == [5 + 12, 9 + 12, 3 + 12] and got["prompt_tokens"] == [5, 9, 3]
    assert got["batch"] == 3 and got["tp"] == got["dp"] == 1 and got["new_tokens"] == 12
    assert got["tpot_s"]["steps"] == 11 and got["tpot_s"]["p50"] <= got["tpot_s"]["p99"]
    assert got["tokens_per_s"] == pytest.approx(3 * got["tokens_per_s_per_sequence"])
    context, (layers, width) = 9 + 12, (1, 16)  # the test run's GPT (test_checkpoint.gpt): block_size 8
    assert got["context"] == min(8, context) and got["kv_cache_bytes"] == 2 * layers * 3 * 8 * width * 4
    assert got["peak_bytes"] > got["kv_cache_bytes"] and not got["stopped"]
    assert cli.main(["sample", str(gpt_run), "--prompt", "to", "--batch", "4", "--tokens", "5", "--json"]) == 0
    four = json.loads(capsys.readouterr().out)["texts"]
    assert len(four) == 4 and len(set(four)) > 1  # four streams


def test_ctrl_c_ends_a_long_request_with_the_text_so_far(gpt_run):  # noqa: F811
    """``--tokens`` of a billion: a progress line, and Ctrl-C prints what was drawn, its
    figures, and exits 130."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "mpitrain", "sample", str(gpt_run), "--tokens", "1000000000"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    first = proc.stderr.readline()  # the progress line, printed after the first step: drawing has begun
    assert "/1,000,000,000 tokens" in first, first
    time.sleep(0.5)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "Ctrl-C: printing what is drawn so far" in err and "stopped early (a stop signal)" in err
    assert len(out.strip()) > 10
