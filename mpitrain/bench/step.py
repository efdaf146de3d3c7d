"""``mpitrain bench step``: training-step speed against the machine's matmul speed.

Times full training steps (forward, backward, optimizer update) of two reference models
on random data, and a large float32 matmul, round by round, and prints medians over the
rounds: each model's ms/step, GFLOP/s, GFLOP/step (counted from shapes,
:mod:`mpitrain.observe.flops`) and *ratio*, its GFLOP/s as a fraction of the matmul's,
against the one it is held to (:data:`TARGETS`). The models: nanoGPT's small CPU setting
(:data:`~mpitrain.bench.measure.NANOGPT`, batch 12, no bias, no dropout), AdamW, clipping
at 1.0; a CNN on batch 64 of 32x32x3, conv3x3(16) ReLU conv3x3(32) ReLU maxpool2
linear(10), SGD with momentum 0.9.

Each model also runs on the plain paths (``ops.fast_paths(False)``: nanoGPT's block op
by op with the textbook GELU; whole-batch im2col convolution and max-pooling), in the
same rounds, printed under its fast row with its time as a multiple of the fast row's
(the median of the per-round quotients): a figure to know, not a target.

When PyTorch is importable (a tool to compare with, never a dependency), its equivalent
steps (:mod:`mpitrain.bench.torch_step`) run in the same rounds, each printed with
mpitrain's time as a multiple of PyTorch's; their GFLOP/s count the same FLOPs.
"""

from __future__ import annotations

import numpy as np

from mpitrain import cost, nn, ops, optim, rng
from mpitrain.bench import torch_step
from mpitrain.bench.measure import NANOGPT, VOCAB, gpt, interleaved, seconds
from mpitrain.observe.flops import count_flops
from mpitrain.runtime import huge_page_heap, limit_blas_threads, tune_allocator
from mpitrain.tensor import Tensor

MATMUL_N = 2048
TARGETS = {"gpt": 0.45, "cnn": 0.25}


def _gpt_step():
    model, opt = gpt()
    x, y = np.random.default_rng(1).integers(0, VOCAB, (2, 12, NANOGPT["block_size"]))

    def step():
        model(x, y)[1].backward()
        optim.clip_grad_norm(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()

    return step, "GPT 4L/4H/128C T=64 B=12, AdamW"


def _cnn_step():
    model = nn.ConvNet(in_channels=3, image_size=32, num_classes=10, channels=(16, 32))
    opt = optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    gen = np.random.default_rng(2)
    x = gen.standard_normal((64, 32, 32, 3)).astype(np.float32)
    y = gen.integers(0, 10, 64)

    def step():
        ops.cross_entropy(model(Tensor(x)), y).backward()
        opt.step()
        opt.zero_grad()

    return step, "CNN conv16-conv32-pool-fc B=64 32x32x3, SGD"


def _ours(name: str) -> str:
    """The mpitrain row a PyTorch row compares with: ``cnn_torch_cl`` -> ``cnn``."""
    return name.split("_")[0]


def _plain(make):
    """``make()``'s step on a model of its own, run with the fast paths off."""
    step, title = make()

    def plain_step():
        with ops.fast_paths(False):
            step()

    return plain_step, f"{title.split()[0]} plain (fast paths off)"


# how the factors are taken: round by round (the medians of the ms columns, taken apart, can
# disagree with it when the machine's speed drifts during the run)
PAIRED = "the median of the per-round quotients"


def run(threads: int = 1, rounds: int = 7, steps: int = 5, torch: bool = True, log=print) -> dict:
    """Measure and print; returns {name: {"ms", "gflops", "ratio", ...}} (medians), the
    plain rows as "gpt_plain" and "cnn_plain" with "of_fast", their time over the fast one's;
    with PyTorch importable and ``torch``, its rows ("gpt_torch", "cnn_torch", "cnn_torch_cl")
    with "mpitrain_over", mpitrain's time over PyTorch's."""
    tune_allocator()
    with limit_blas_threads(threads):
        rng.manual_seed(0)
        a, b = np.random.default_rng(0).standard_normal((2, MATMUL_N, MATMUL_N), dtype=np.float32)
        product_flops = cost.matmul_flops(MATMUL_N, MATMUL_N, MATMUL_N)
        models = {"gpt": _gpt_step(), "gpt_plain": _plain(_gpt_step),
                  "cnn": _cnn_step(), "cnn_plain": _plain(_cnn_step)}
        flops = {name: count_flops(step).total for name, (step, _) in models.items()}
        if torch and torch_step.available():
            models.update(torch_step.steps(threads))
            flops.update({name: flops[_ours(name)] for name in models if name.endswith(("_torch", "_torch_cl"))})
        for step, _ in models.values():
            seconds(step, 3)  # warm up: allocator, caches, optimizer state
        seconds(lambda: a @ b, 2)
        huge_page_heap()  # as the trainer does after its first steps
        calls = {"matmul": (lambda: a @ b, 3), **{name: (step, steps) for name, (step, _) in models.items()}}
        times = interleaved(calls, rounds, lambda call: seconds(*call))  # matmul first in each round
    peak = [product_flops / s for s in times["matmul"]]
    med = float(np.median(peak))
    log(f"mpitrain bench step: {threads} BLAS thread(s), {rounds} rounds of {steps} steps, medians")
    log(f"  float32 matmul {MATMUL_N}^3                          {med / 1e9:7.1f} GFLOP/s")
    out = {"matmul_gflops": med / 1e9}
    for name, (_, title) in models.items():
        m = 1e3 * float(np.median(times[name]))
        r = float(np.median([flops[name] / s / p for s, p in zip(times[name], peak)]))
        g = flops[name] / (m / 1e3) / 1e9
        out[name] = {"ms": m, "gflops": g, "ratio": r, "gflop_per_step": flops[name] / 1e9}
        if name in TARGETS:
            note = f"target >= {TARGETS[name]}: {'ok' if r >= TARGETS[name] else 'BELOW'}"
        elif "_torch" in name:  # PyTorch's: mpitrain's time in the same rounds over this one's
            out[name]["mpitrain_over"] = float(np.median(np.divide(times[_ours(name)], times[name])))
            note = f"mpitrain's step x{out[name]['mpitrain_over']:.2f} of this, {PAIRED}"
        else:  # a plain row: its time in the same rounds as its fast row's
            fast = name.removesuffix("_plain")
            out[name]["of_fast"] = float(np.median(np.divide(times[name], times[fast])))
            note = f"x{out[name]['of_fast']:.2f} the fast row's time, {PAIRED}"
        log(f"  {title:45s} {m:7.1f} ms/step {g:7.1f} GFLOP/s  "
            f"{flops[name] / 1e9:.2f} GFLOP/step  ratio {r:.3f} ({note})")
    return out
