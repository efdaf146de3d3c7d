"""Calibration: measuring this machine as mpitrain runs on it, and writing what it measured
as a hardware file (:mod:`mpitrain.plan.hardware` reads it).

* the device (:func:`measure_device`): GEMMs at the shapes mpitrain's models multiply,
  streaming bandwidth, the cost of a tiny op;
* mpitrain's own work beyond the products (:mod:`mpitrain.plan.steps`): training steps of
  small models built for real, less their GEMMs' predicted time, split into passes over
  their traffic and fixed times per layer, and what mixed precision adds;
* links (:func:`measure_link`, :func:`fit_link`): a ping-pong of 2 ranks, on shared memory
  or across an emulated link, fitted to Hockney's ``alpha + n / bandwidth``; and how much
  of a nonblocking collective compute beside it hides; and what a blocking call costs
  between 2 ranks that take turns on one core (:func:`measure_turns`). The programs the
  ranks run: :mod:`mpitrain.plan.probes`.

:func:`calibrate` runs them all and writes ``[device.this]`` and ``[link.*]``.
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from mpitrain.config import toml_value
from mpitrain.output import write_text
from mpitrain.plan.hardware import (GEMM_DTYPES, MIXED, HardwareError, emulated_link, parse_device, read_toml,
                                    this_machine, user_path)
from mpitrain.plan.objects import measure_objects
from mpitrain.plan.probes import probed
from mpitrain.plan.steps import PROBES, measure_mixed, measure_steps, significant
from mpitrain.runtime import available_cores, my_cores

# the GEMMs that matter here, (m, k, n) of (m,k)@(k,n), float32 unless a dtype is named
GPT_SHAPES = [  # jobs/tinyshakespeare_gpt.toml: 12 x 64 = 768 tokens, width 128, 4 heads of 32, 65 characters
    (768, 128, 384), (768, 128, 128), (768, 128, 512), (768, 512, 128), (768, 128, 65),  # qkv, proj, MLP, head
    (128, 768, 384), (512, 768, 128),  # weight gradients x^T g: the tokens inside
    (64, 32, 64), (64, 64, 32)]  # one head's scores q k^T, and its weighted values
CNN_SHAPES = [  # im2col GEMMs of a whole batch (the plain path's; pixels, c_in k k, c_out): mnist_lenet.toml
    (50176, 25, 16), (12544, 400, 32), (64, 1568, 128),  # (batch 64), cifar10_resnet.toml (128)
    (131072, 27, 16), (131072, 144, 16), (32768, 288, 32), (8192, 576, 64)]
SKINNY = [(2048, 64, 2048), (64, 2048, 64)]  # a rank-64 update, long inner products
DEFAULT_SHAPES = ([(s, s, s) for s in (64, 128, 256, 512, 1024, 2048)] + GPT_SHAPES + CNN_SHAPES + SKINNY
                  + [(s, s, s, "float64") for s in (256, 1024)])


# ------------------------------------------------------------------ a quiet machine
BUSY_CORES = 0.25  # other processes' CPU, in cores, above which a calibration is refused


def others_busy(seconds: float = 0.5) -> float | None:
    """Cores' worth of CPU time that other processes used on this process's cores while it
    slept ``seconds``: the non-idle time of those cores in Linux's ``/proc/stat`` (a virtual
    machine's stolen time counts: its host's other work); None where it cannot be read."""
    cores = {f"cpu{c}" for c in my_cores()}

    def ticks() -> int:
        rows = [line.split() for line in Path("/proc/stat").read_text().splitlines()]
        # user nice system idle iowait irq softirq steal: all but idle and iowait
        return sum(sum(map(int, r[1:4])) + sum(map(int, r[6:9])) for r in rows if r and r[0] in cores)

    try:
        before = ticks()
        time.sleep(seconds)
        return (ticks() - before) / os.sysconf("SC_CLK_TCK") / seconds
    except (OSError, ValueError, IndexError):
        return None


def check_quiet(when: str, busy_ok: bool, log) -> None:
    """Refuse to calibrate (HardwareError), or with ``busy_ok`` warn, when other processes
    use more than :data:`BUSY_CORES` of this process's cores (:func:`others_busy`): what
    they take, every figure measured would lose, and every plan after it would inherit."""
    others = others_busy()
    if others is None or others <= BUSY_CORES:
        return
    said = (f"the machine is busy {when}: other processes used {others:.2g} of the {available_cores()} core(s) "
            "calibration measures")
    if not busy_ok:
        raise HardwareError(f"{said}; nothing was written. Calibrate when it is quiet (or with --busy-ok to write "
                            "it anyway)")
    log(f"warning: {said}; writing it anyway (--busy-ok): its figures are lower than this machine's")


# ------------------------------------------------------------------ the device
def tile_shapes(threads: int) -> list[tuple]:
    """The convolutions' products as the fast path multiplies them on ``threads`` BLAS threads,
    a tile of images at a time (:meth:`~mpitrain.plan.shapes.Layer.product_rows`): those of
    LeNet on 28x28x1 and of the ConvNet and the ResNets (any depth) on 32x32x3, float32."""
    from mpitrain.plan import shapes

    models = (shapes.lenet((28, 28, 1), 10), shapes.convnet((32, 32, 3), 10), shapes.resnet((32, 32, 3), 10))
    return sorted({(layer.product_rows(64, 4, threads), *layer.gemm[1:]) for model in models
                   for layer in model.layers if layer.tiled})


def measure_device(shapes=None, repeats: int = 5, log=print) -> dict:
    """The ``[device.this]`` table: GFLOP/s of ``np.matmul`` (m,k)@(k,n) into a reused
    output (2 m k n FLOPs) at ``shapes`` ((m, k, n) or (m, k, n, dtype); default
    :data:`DEFAULT_SHAPES` and the convolutions' tiles, :func:`tile_shapes`), at one BLAS
    thread and at one per core (a rank alone on the machine gets them all:
    :func:`mpitrain.runtime.blas_threads`); streaming over float32
    arrays of 32 MiB, beyond the caches and preallocated (no page faults): a copy reads and
    writes one, ``np.add`` reads two and writes one; and a tiny op, ``np.add`` of 16
    elements in a Python call. Every figure is the best of ``repeats`` rounds, each round
    timing every figure once (:func:`_rounds`): a slow spell of the machine spoils one
    round of each, not every round of some."""
    gen = np.random.default_rng(0)
    arrays, tasks = {}, {}
    for threads in sorted({1, available_cores()}):
        for shape in (DEFAULT_SHAPES + tile_shapes(threads)) if shapes is None else shapes:
            m, k, n, dtype = (*shape, "float32")[:4]
            if dtype not in GEMM_DTYPES:
                raise HardwareError(f"GEMM shape {shape}: dtype must be one of {', '.join(GEMM_DTYPES)}")
            if (m, k, n, dtype) not in arrays:  # the operands and output, reused at every thread count
                arrays[m, k, n, dtype] = (gen.standard_normal((m, k)).astype(dtype),
                                          gen.standard_normal((k, n)).astype(dtype), np.empty((m, n), dtype))
            tasks[m, k, n, dtype, threads] = (threads, lambda a, b, c: np.matmul(a, b, out=c), arrays[m, k, n, dtype])
    (a, b, c), x = (np.ones(1 << 23, np.float32) for _ in range(3)), np.zeros(16, np.float32)
    tasks.update({"copy": (1, np.copyto, (c, a)), "add": (1, lambda a, b, c: np.add(a, b, out=c), (a, b, c)),
                  "tiny": (1, lambda x: np.add(x, x, out=x), (x,))})  # a lambda: a Python call, as an op's
    best = _rounds(tasks, repeats)
    rows = []
    for (m, k, n, dtype, threads), seconds in ((key, t) for key, t in best.items() if isinstance(key, tuple)):
        rows.append([int(m), int(k), int(n), dtype, significant(2 * m * k * n / seconds / 1e9), threads])
        log(f"gemm ({m}, {k}) @ ({k}, {n}) {dtype}, {threads} thread(s): {rows[-1][4]:g} GFLOP/s")
    copy, add, tiny = 2 * a.nbytes / best["copy"], 3 * a.nbytes / best["add"], best["tiny"]
    log(f"streaming: copy {copy / 1e9:.3g} GB/s, add {add / 1e9:.3g} GB/s; a tiny op {tiny * 1e6:.3g} us")
    best = {d: significant(max([r[4] / 1e3 for r in rows if r[3] == d and r[5] == 1], default=0.0))  # TFLOP/s, a core's
            for d in GEMM_DTYPES}
    if not best["float32"]:
        raise HardwareError("calibration needs a float32 GEMM shape at least")
    fp32 = best["float32"]
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return {"name": this_machine(), "memory_gb": significant(memory / 1e9),
            "memory_bandwidth_gbs": significant(copy / 1e9), "elementwise_bandwidth_gbs": significant(add / 1e9),
            "op_overhead_us": significant(tiny * 1e6),
            # TFLOP/s; half-precision products run in float32 (precision.py)
            "peak_flops": {"fp64": best["float64"] or significant(fp32 / 2), "fp32": fp32, "bf16": fp32, "fp16": fp32},
            "gemm_gflops": rows}


def _rounds(tasks: dict, repeats: int, least: float = 0.02) -> dict:
    """{key: the fastest seconds per call}: ``tasks`` are ``key: (BLAS threads, fn,
    args)``; in each of ``repeats`` rounds every task is timed once, over as many calls as
    last ``least`` s (counted in the first round, after a call to warm up)."""
    from threadpoolctl import threadpool_limits

    calls, best = {}, {}
    for _ in range(repeats):
        for threads in sorted({t for t, _, _ in tasks.values()}):
            with threadpool_limits(limits=threads, user_api="blas"):
                for key, (t, fn, args) in tasks.items():
                    if t != threads:
                        continue
                    if key not in calls:
                        tick = time.perf_counter()
                        fn(*args)
                        calls[key] = max(1, int(least / max(time.perf_counter() - tick, 1e-9)))
                    tick = time.perf_counter()
                    for _ in range(calls[key]):
                        fn(*args)
                    best[key] = min(best.get(key, math.inf), (time.perf_counter() - tick) / calls[key])
    return best


# ------------------------------------------------------------------ links
def measure_turns() -> float:
    """:func:`~mpitrain.plan.probes.turns` on 2 ranks of this machine pinned to its first
    core (0 where the machine has one core only: its ranks always take turns, and the
    calibration's other figures hold that already)."""
    from mpitrain.cluster import mpiexec

    pin = shutil.which("taskset")
    if pin is None or len(my_cores()) < 2:
        return 0.0
    argv = [pin, "-c", str(my_cores()[0]), mpiexec(), "-n", "2", *_probe("turns")]
    return probed(subprocess.run(argv, capture_output=True, text=True, timeout=300, check=False),
                  "the probe of 2 ranks on one core")["turns"]


def _probe(name: str, *options: str) -> list[str]:
    """The command line of a rank of :mod:`mpitrain.plan.probes`."""
    return [sys.executable, "-m", "mpitrain.plan.probes", name, *options]


def fit_link(rows: list) -> tuple[float, float]:
    """(alpha s, bandwidth B/s) of ``t = alpha + n / bandwidth`` through one-way times, by least
    squares in each regime: the slope through messages of 1/16 of the largest and up, then
    the intercept it leaves messages of 64 B or less. One fit through all sizes lets 16 MiB's
    milliseconds swamp the microseconds (its intercept came out negative), and an emulated
    link's token bucket passes small messages faster than its rate."""
    n, t = np.array(rows, dtype=np.float64).T  # (sizes,) bytes, seconds
    big, small = n >= n.max() / 16, n <= 64
    if big.sum() < 2 or not small.any():
        raise HardwareError("a link fit needs messages from 8 B to 128 B or more")
    per_byte = np.polyfit(n[big], t[big], 1)[0]
    alpha = float(np.mean(t[small] - n[small] * per_byte))
    if alpha <= 0 or per_byte <= 0:
        raise HardwareError(f"the link fit came out alpha {alpha:.3g} s, {per_byte:.3g} s/B: the machine was too "
                            "busy to measure; calibrate again")
    return alpha, float(1 / per_byte)


def measure_link(rate_gbit: float | None, max_bytes: int = 16 << 20, repeats: int = 5) -> tuple[list, float]:
    """(ping-pong rows, :func:`~mpitrain.plan.probes.overlap`) of 2 ranks on shared memory
    (``rate_gbit`` None), or of 2 emulated nodes of 1 rank linked at ``rate_gbit``
    (``mpitrain cluster``; ClusterError where it cannot be)."""
    from mpitrain.cluster import Cluster, mpiexec

    argv = _probe("pingpong", "--max-bytes", str(max_bytes), "--repeats", str(repeats))
    run = lambda cmd: subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)  # noqa: E731
    if rate_gbit is None:
        done, what = run([mpiexec(), "-n", "2", *argv]), "shared memory"
    else:
        with Cluster(nodes=2, ranks=1, rate=f"{rate_gbit * 1000:g}mbit") as cluster:
            done, what = run(cluster.command(argv)), f"an emulated {rate_gbit:g} Gbit/s link"
    found = probed(done, f"the ping-pong over {what}")
    return found["pingpong"], found["overlap"]


def _links(links, rates_gbit, max_bytes: int, repeats: int, log) -> dict:
    """The ``[link.*]`` tables of :func:`calibrate`."""
    from mpitrain.cluster import ClusterError

    measured = {}
    for key, rate in [(k, None) for k in links] + [(emulated_link(r * 1e9), float(r)) for r in rates_gbit]:
        if rate is None and key != "shm":
            raise HardwareError(f"link {key!r}: calibration measures shm, and emulated links by their rate")
        try:
            rows, hidden = measure_link(rate, max_bytes, repeats)
        except ClusterError as e:
            log(f"{key}: skipped, no emulated cluster here: {e}")
            continue
        alpha, bandwidth = fit_link(rows)
        measured[key] = {"name": "shared memory, 2 MPI ranks on one node (calibrated)" if rate is None else
                         f"emulated {rate:g} Gbit/s link, mpitrain cluster 2 nodes x 1 rank (calibrated)",
                         "alpha_us": significant(alpha * 1e6), "bandwidth_gbs": significant(bandwidth / 1e9),
                         **({"per_node": True} if rate is not None else {}), "overlap": hidden}
        log(f"{key}: alpha {alpha * 1e6:.3g} us, bandwidth {bandwidth / 1e9:.4g} GB/s (8 B to {rows[-1][0]} B); "
            f"compute hides of a call: {', '.join(f'{k} {v:.0%}' for k, v in hidden.items())}")
    return measured


# ------------------------------------------------------------------ all of it, written
def calibrate(shapes=None, links=("shm",), rates_gbit=(), out=None, log=print, *, repeats: int = 5,
              max_bytes: int = 16 << 20, probes=PROBES, busy_ok: bool = False) -> dict:
    """Measure this machine (:func:`measure_device`, then
    :func:`~mpitrain.plan.steps.measure_steps` of ``probes`` at its GEMM rates,
    :func:`~mpitrain.plan.steps.measure_mixed` of the first, a GPT, and Python's objects at
    rest, :func:`~mpitrain.plan.objects.measure_objects`) and its links:
    ``"shm"`` in ``links``, ``emu-<R>g`` for
    each rate R in ``rates_gbit`` (skipped, saying why, where no emulated cluster can be
    made); write them as ``[device.this]`` and ``[link.*]`` into ``out`` (default
    :func:`~mpitrain.plan.hardware.user_path`) atomically, keeping the entries of an
    existing file that were not measured again. Each timing is the best of ``repeats``.
    Refused (HardwareError, nothing written) when other processes use the cores before,
    during or after it (:func:`check_quiet`; ``busy_ok``: a warning). Returns the tables
    measured."""
    check_quiet("before calibrating", busy_ok, log)
    this = measure_device(shapes, repeats, log)
    check_quiet("while its GEMMs were measured", busy_ok, log)
    this["passes"], this["layer_overhead_us"], this["step_overhead_us"] = measure_steps(
        parse_device("this", this, "the device measured"), probes, repeats, log)
    this["mixed_ns_per_parameter"], this["cast_ns_per_number"] = measure_mixed(probes[0], MIXED, repeats, log)
    this["objects_kb"], this["objects_kb_per_array"] = measure_objects(log)
    switch = measure_turns()
    if switch:
        this["switch_us"] = significant(switch * 1e6)
    log(f"a blocking call between 2 ranks on one core: {switch * 1e6:.3g} us added")
    for name in ("passes", "layer_overhead_us", "step_overhead_us", "mixed_ns_per_parameter", "cast_ns_per_number"):
        log(f"{name}: {', '.join(f'{k} {v:g}' for k, v in this[name].items()) or 'none measured'}")
    measured = {"device": {"this": this}, "link": _links(links, rates_gbit, max_bytes, repeats, log)}
    check_quiet("at the end of calibrating", busy_ok, log)
    log(against_shipped(this["gemm_gflops"]))
    out = Path(out) if out is not None else user_path()
    merged = read_toml(out) if out.exists() else {}
    for kind, entries in measured.items():
        merged.setdefault(kind, {}).update(entries)
    command = " ".join([Path(sys.argv[0]).name, *sys.argv[1:]])
    write_text(out, to_toml(merged, f"measured by mpitrain.plan.calibrate {time.strftime('%Y-%m-%d')}: {command}"))
    log(wrote(out, measured))
    return measured


SLOWER = 0.9  # a calibration's median GEMM rate against the shipped one of its kind below which it is doubted


def against_shipped(rows: list, shipped=None) -> str:
    """A line comparing the GEMM ``rows`` just measured with the shipped calibration of
    this machine's kind (:func:`mpitrain.plan.hardware.load`'s "this"), shape by shape: the
    median ratio and how many are within a tenth of it; a warning where the median is below
    :data:`SLOWER` (a slow spell the busy check did not see); where none ships, a line
    saying so."""
    from mpitrain.plan.hardware import SHIPPED, load, this_cpu

    theirs = (shipped or load(SHIPPED)).device("this")
    if theirs.name.partition(";")[0].strip() != this_cpu():
        return f"no shipped calibration of this kind of machine ({this_cpu()}) to compare with"
    known = {(m, k, n, dtype, threads): rate for m, k, n, dtype, rate, threads in theirs.gemm}
    ratios = sorted(r[4] * 1e9 / known[tuple(r[:4]) + (r[5],)] for r in rows if tuple(r[:4]) + (r[5],) in known)
    if not ratios:
        return "no GEMM shape in common with the shipped calibration of this kind of machine"
    median = ratios[len(ratios) // 2]
    said = (f"against the shipped calibration of this kind of machine: GEMM rates a median {median:.3g} of its, "
            f"within 10% on {sum(abs(x - 1) <= 0.1 for x in ratios)} of {len(ratios)} shapes")
    if median < SLOWER:
        said = (f"warning: {said}: slower than this kind of machine measured quietly; was it busy (its host, "
                "or a process outside this one's view)? Calibrate again when it is quiet")
    return said


def wrote(out: Path, measured: dict) -> str:
    """What a calibration wrote, and where, and who reads it."""
    this = measured["device"]["this"]
    links = ", ".join(f"{k} ({v['alpha_us']:.3g} us, {v['bandwidth_gbs']:.3g} GB/s)"
                      for k, v in measured["link"].items()) or "none"
    reader = ("mpitrain plan, --validate and a run's closing plan lines read it from now on for --hardware this"
              if out == user_path() else f"Use it with mpitrain plan --catalogue {out}")
    return (f"wrote {out}: [device.this] {this['name']}: float32 GEMMs up to {this['peak_flops']['fp32'] * 1e3:.4g} "
            f"GFLOP/s a core, streaming {this['elementwise_bandwidth_gbs']:.4g} GB/s; links {links}. {reader} "
            "(other entries of the file are kept)")


def _toml(v) -> str:
    try:
        return toml_value(v)
    except ValueError as e:  # a measurement that is not a finite number
        raise HardwareError(f"the calibration: {e}") from None


def to_toml(tables: dict, header: str = "") -> str:
    """Nested dicts of numbers, strings, booleans and arrays as TOML, ``header`` a comment."""
    lines = [f"# {line}" for line in header.splitlines()]
    key = lambda k: k if k.replace("-", "").replace("_", "").isalnum() and k.isascii() else _toml(k)  # noqa: E731

    def emit(name: str, table: dict) -> None:
        values = {k: v for k, v in table.items() if not isinstance(v, dict)}
        lines.extend(["", f"[{name}]"] if name and (values or not table) else [])
        lines.extend(f"{key(k)} = {_toml(v)}" for k, v in values.items())
        for k, v in table.items():
            if isinstance(v, dict):
                emit(f"{name}.{key(k)}" if name else key(k), v)

    emit("", tables)
    return "\n".join(lines).lstrip("\n") + "\n"


def main(argv=None) -> int:
    """Calibrate this machine into ``--out`` (default the user's file)."""
    p = argparse.ArgumentParser(prog="python -m mpitrain.plan.calibrate", description=main.__doc__)
    p.add_argument("--max-bytes", type=int, default=16 << 20, help="the largest message (default 16 MiB)")
    p.add_argument("--repeats", type=int, default=5, help="rounds of each figure, whose best counts (default 5)")
    p.add_argument("--busy-ok", action="store_true", help="write the calibration even if other processes use the "
                                                             "cores (warning instead of refusing)")
    p.add_argument("--rates-gbit", type=float, nargs="*", default=[], help="emulated links to measure, Gbit/s each")
    p.add_argument("--out", help="the hardware file to write (default $MPITRAIN_HARDWARE, else the user's)")
    args = p.parse_args(argv)
    calibrate(rates_gbit=args.rates_gbit, out=args.out, repeats=args.repeats, max_bytes=args.max_bytes,
              busy_ok=args.busy_ok)
    return 0


if __name__ == "__main__":
    sys.exit(main())
