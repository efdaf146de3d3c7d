"""Calibration's training steps: mpitrain's own work beyond the products, measured on small
models built for real and timed as the trainer runs them (one BLAS thread, its allocator
and huge pages), then split by least squares into what grows with the batch (passes over
the layers' traffic), what each micro-batch and each step pay whatever their size, and
what mixed precision adds (:func:`measure_steps`, :func:`measure_mixed`;
:mod:`mpitrain.plan.calibrate` writes what they find, :mod:`mpitrain.plan.timing` uses it).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from mpitrain.plan import shapes as model_shapes
from mpitrain.plan.hardware import MIXED, HardwareError

def best_seconds(fn, repeats: int, least: float = 0.02) -> float:
    """The fastest of ``repeats`` repeats' seconds per call of ``fn``, a repeat lasting
    ``least`` s or more. The best, as :mod:`timeit` advises: a slower repeat is the machine's
    other work (another process, an interrupt), not ``fn``'s."""
    tick = time.perf_counter()
    fn()
    calls, times = max(1, int(least / max(time.perf_counter() - tick, 1e-9))), []
    for _ in range(repeats):
        tick = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - tick) / calls)
    return min(times)


def significant(x: float) -> float:  # four significant digits: a measurement's noise is percents
    return float(f"{x:.4g}")


def gemm_seconds(dev, model, batch: int) -> float:
    """The products of a step of ``model`` (a :class:`~mpitrain.plan.shapes.ModelShape`) at
    ``batch`` in float32 on one BLAS thread, forward and backward, each layer at ``dev``'s rate
    for its typical product on the rows mpitrain multiplies at once
    (:meth:`~mpitrain.plan.shapes.Layer.product_rows`), as :class:`mpitrain.plan.timing.Machine` rates them."""
    seconds = 0.0
    for layer in model.layers:
        flops = (layer.forward * (1 + layer.recompute) + layer.backward) * batch
        if flops:
            _, k, n = layer.gemm or (1, 256, 256)
            seconds += flops / dev.matmul_flops_per_s(layer.product_rows(batch, 4), k, n)
    return seconds


def split_steps(dev, timed: list) -> tuple[float, float, float]:
    """(passes, seconds per layer and micro-batch, seconds per layer and step) that fit
    steps timed at several batches and micro-batches, ``timed`` [(model, batch, micro-batches,
    seconds), ...], in least squares: the time beyond the products (:func:`gemm_seconds`)
    is a part that grows with the batch, passes over the traffic of float32 numbers at
    ``dev``'s elementwise bandwidth, a part each micro-batch pays
    whatever its size (Python, each op's call) and a part each step pays (the update's
    calls per tensor), both per layer. Where noise makes a part negative it is left out
    and the rest fitted again."""
    rows = [(4 * b * m * sum(x.traffic for x in model.layers) / dev.elementwise_bandwidth, len(model.layers) * m,
             len(model.layers)) for model, b, m, _ in timed]
    rest = np.array([t - m * gemm_seconds(dev, model, b) for model, b, m, t in timed])
    for used in ((0, 1, 2), (0, 1), (0,)):
        fit, *_ = np.linalg.lstsq(np.array(rows)[:, used], rest, rcond=None)
        if all(fit > 0):
            break
    found = dict(zip(used, map(float, fit)))
    return found[0], found.get(1, 0.0), found.get(2, 0.0)


@dataclass(frozen=True)
class Probe:
    """A model to time: ``make()`` builds it for real and returns (step, its ModelShape, batch),
    ``step(b, m)`` a training step on ``m`` micro-batches of ``b`` samples of the batch
    (a GPT's ``make(precision)``: in mixed precision)."""

    name: str
    family: str
    make: object


def gpt_probe(V=84, T=64, L=4, H=4, C=128, batch=12, path: str = "gpt") -> Probe:
    """:class:`mpitrain.nn.GPT` (default: jobs/shakespeare_gpt.toml's), AdamW, random tokens,
    its blocks run as ``path`` runs them (:data:`mpitrain.plan.hardware.FAMILIES`): fused
    ("gpt"), op by op through tensor slicing's layers (``slice_gpt`` on one rank,
    "gpt-sliced"; with sequence parallelism, "gpt-sequence"), or op by op on the plain
    path (fast paths off, "gpt-plain"), there with backward in a zero-bubble schedule's two
    passes ("gpt-split"); ``make(precision)`` trains in mixed precision (bf16, fp16) as the
    trainer does."""
    def make(precision: str = "fp32"):
        from mpitrain import autograd, nn, ops, optim
        from mpitrain.comm import SingleComm
        from mpitrain.parallel.tensor_parallel import slice_gpt
        from mpitrain.precision import MixedPrecision

        model = nn.GPT(nn.GPTConfig(vocab_size=V, block_size=T, n_layer=L, n_head=H, n_embd=C))
        if path in ("gpt-sliced", "gpt-sequence"):
            slice_gpt(model, SingleComm(), sequence=path == "gpt-sequence")
        opt = optim.AdamW(model.parameters(), 1e-3)
        opt = opt if precision == "fp32" else MixedPrecision(opt, precision)
        x, y = np.random.default_rng(0).integers(0, V, (2, batch, T))

        def step(b: int, m: int = 1):
            with ops.fast_paths(path not in ("gpt-plain", "gpt-split")):
                for i in range(m):  # micro-batches, their gradients accumulated
                    loss = model(x[i * b : (i + 1) * b], y[i * b : (i + 1) * b])[1]
                    if path == "gpt-split":  # a zero-bubble stage's B, then its W
                        autograd.backward_split([loss]).run()
                    else:
                        loss.backward()
            if precision == "fp32" or not opt.check():
                opt.step()
            opt.zero_grad()
        return step, model_shapes.gpt(V, T, L, H, C), batch
    return Probe(f"gpt{'' if path == 'gpt' else ' ' + path[4:]} {L}L/{H}H/{C}C T{T} B{batch}", path, make)


def cnn_probe(name: str, sample=(32, 32, 3), batch=64, **config) -> Probe:
    """mpitrain's CNN ``name`` (lenet, convnet, resnet) on random images of ``sample``
    (H, W, C), AdamW; ``config``: the model's own (channels, widths, blocks, ...)."""
    def make():
        from mpitrain import nn, ops, optim

        H, _, c = sample
        model = {"lenet": nn.LeNet, "convnet": nn.ConvNet, "resnet": nn.ResNet}[name](c, H, 10, **config)
        opt = optim.AdamW(model.parameters(), 1e-3)
        gen = np.random.default_rng(0)
        x, y = gen.standard_normal((batch, *sample)).astype(np.float32), gen.integers(0, 10, batch)

        def step(b: int, m: int = 1):
            for i in range(m):
                ops.cross_entropy(model(x[i * b : (i + 1) * b]), y[i * b : (i + 1) * b]).backward()
            opt.step()
            opt.zero_grad()
        return step, getattr(model_shapes, name)(tuple(sample), 10, **config), batch
    label = name + "".join(f" {k}={v}" for k, v in config.items())
    return Probe(f"{label} {'x'.join(map(str, sample))} B{batch}", "cnn", make)


PROBES = (gpt_probe(), *(gpt_probe(path=f"gpt-{p}") for p in ("sliced", "sequence", "plain", "split")),
          cnn_probe("lenet", (28, 28, 1)), cnn_probe("resnet", blocks=1))  # resnet8



def _step_seconds(step, b: int, repeats: int) -> float:
    """The fastest of ``repeats`` calls of ``step(b)`` (:func:`best_seconds`) after three to
    warm up, huge pages as the trainer sets them after its warm-up."""
    from mpitrain.runtime import huge_page_heap

    for _ in range(3):
        step(b)
    huge_page_heap()
    times = []
    for _ in range(repeats):
        tick = time.perf_counter()
        step(b)
        times.append(time.perf_counter() - tick)
    return min(times)


def measure_steps(dev, probes=PROBES, repeats: int = 5, log=print) -> tuple[dict, dict, dict]:
    """({family: passes}, {family: microseconds per layer and micro-batch}, {family:
    microseconds per layer and step}) of :func:`split_steps` over the family's ``probes``,
    each timed (:func:`_step_seconds`) at its batch, half and a quarter of it, and as four
    micro-batches of a quarter (a pipeline's), on one BLAS thread with the allocator as the trainer sets it;
    ``dev`` a calibrated :class:`~mpitrain.plan.hardware.Device`, whose GEMM rates the
    products are timed at."""
    from mpitrain import rng
    from mpitrain.runtime import limit_blas_threads, tune_allocator

    timed: dict = {}
    tune_allocator()
    with limit_blas_threads(1):
        for probe in probes:
            rng.manual_seed(0)
            step, model, batch = probe.make()
            if batch < 4:
                raise ValueError(f"probe {probe.name}: a batch of 4 or more is split into four micro-batches")
            half, quarter = batch // 2, batch // 4
            for b, m in ((batch, 1), (half, 1), (quarter, 1), (quarter, 4)):
                seconds = _step_seconds(lambda b, m=m: step(b, m), b, repeats)
                timed.setdefault(probe.family, []).append((model, b, m, seconds))
                log(f"steps {probe.name}, {m} micro-batch(es) of {b}: {seconds * 1e3:.4g} ms, "
                    f"their GEMMs {m * gemm_seconds(dev, model, b) * 1e3:.4g} ms")
    passes, per_micro, per_step = {}, {}, {}
    for family, rows in timed.items():
        p, o, u = split_steps(dev, rows)
        if not p > 0:
            raise HardwareError(f"{family} steps took less than their GEMMs' predicted time: the machine was "
                                "too busy to measure; calibrate again")
        passes[family] = significant(p)
        per_micro.update({family: significant(o * 1e6)} if o > 0 else {})
        per_step.update({family: significant(u * 1e6)} if u > 0 else {})
    return passes, per_micro, per_step


def measure_mixed(probe=PROBES[0], precisions=MIXED, repeats: int = 5, log=print) -> tuple[dict, dict]:
    """({precision: nanoseconds per parameter}, {precision: nanoseconds per number}): what a
    step of a GPT ``probe`` in each mixed precision costs beyond its step in float32, per
    parameter of the model (the casts of the weights into float32 for the products and of
    the gradients into half, the check and the update of the float32 masters:
    :class:`mpitrain.precision.MixedPrecision`); and a half-precision array's round trip
    through float32, per number, what summing a bucket of half gradients adds
    (:class:`mpitrain.comm.ring.Float32Sum`)."""
    from mpitrain import rng
    from mpitrain.dtypes import dtype_of
    from mpitrain.runtime import limit_blas_threads, tune_allocator

    per_parameter, per_number = {}, {}
    tune_allocator()
    with limit_blas_threads(1):
        rng.manual_seed(0)
        step, model, batch = probe.make()
        plain = _step_seconds(step, batch, repeats)
        for precision in precisions:
            rng.manual_seed(0)
            step, model, batch = probe.make(precision)
            seconds = _step_seconds(step, batch, repeats)
            per_parameter[precision] = significant(max(seconds - plain, 0.0) / model.count() * 1e9)
            half = np.ones(1 << 22, dtype_of(precision))
            trip = best_seconds(lambda: np.copyto(half, half.astype(np.float32), casting="same_kind"), repeats)
            per_number[precision] = significant(trip / half.size * 1e9)
            log(f"mixed {probe.name} {precision}: {seconds * 1e3:.4g} ms, in float32 {plain * 1e3:.4g} ms: "
                f"{per_parameter[precision]:g} ns per parameter; a round trip through float32 "
                f"{per_number[precision]:g} ns per number")
    return {p: ns for p, ns in per_parameter.items() if ns > 0}, per_number
