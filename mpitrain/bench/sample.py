"""``mpitrain bench sample``: a token's step with the key-value cache against the whole
window through the model again (recomputation), on the shipped GPT's shape
(``jobs/shakespeare_gpt.toml``: nanoGPT's small CPU setting, 84 characters) with room for
the contexts asked (``block_size`` the largest; the weights drawn, not trained: a step's
time is its shapes'). Each row: ``tokens`` steps after a prompt that ends them at the
context, both ways in each of ``rounds`` rounds, the median step kept."""

from __future__ import annotations

import numpy as np

from mpitrain import nn, rng
from mpitrain.bench.measure import NANOGPT, interleaved, medians
from mpitrain.runtime import limit_blas_threads
from mpitrain.train import sampling

VOCAB = 84  # the shakespeare package's characters


def run(contexts=(64, 256), batches=(1, 8), tokens: int = 16, rounds: int = 5, threads: int = 1, log=print) -> dict:
    rng.manual_seed(0)
    model = nn.GPT(nn.GPTConfig(vocab_size=VOCAB, **{**NANOGPT, "block_size": max(contexts)})).eval()
    log(f"a token's step at a context, the shipped GPT's shape ({NANOGPT['n_layer']} layers x {NANOGPT['n_embd']}, "
        f"{NANOGPT['n_head']} heads), {threads} BLAS thread(s), median of {rounds} rounds x {tokens} tokens")
    log("batch | context | with the cache ms | recomputed ms | recomputed / cached")
    rows = {}
    with limit_blas_threads(threads):
        for batch in batches:
            for context in contexts:
                prompts = [np.arange(context - tokens + 1) % VOCAB] * batch

                def timed(cache):
                    return sampling.generate(model, prompts, tokens, block_size=max(contexts), cache=cache).steps

                step = medians(interleaved({"cached": True, "recomputed": False}, rounds, timed))
                ratio = step["recomputed"] / step["cached"]
                rows[(batch, context)] = {**step, "ratio": ratio}
                log(f"{batch} | {context} | {step['cached'] * 1e3:.3g} | {step['recomputed'] * 1e3:.3g} | {ratio:.3g}")
    return rows
