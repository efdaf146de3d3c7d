"""``mpitrain bench memory``: the model state each rank holds, measured, against ZeRO's
formulas (:func:`~mpitrain.cost.bytes_per_parameter`).

For each gradient sync (``ddp``, ``zero1``, ``zero2``, ``zero3``) and each number of
ranks ``P`` (1, 2 and 4 by default) it starts ``mpiexec -n P`` on :func:`worker`, which
trains the GPT of ``bench step`` (float32, and with the syncs that take it mixed
precision ``bf16``, ``fp16``; AdamW, clipping, global batch 12) for three steps with ``tracemalloc`` tracing
every NumPy buffer. The table gives the largest rank's figures (``--json``: every rank's):

* **params**, **grads**, **optim**, **work**: the state counted from the arrays the sync
  keeps (:func:`~mpitrain.observe.memory.model_state`); *work* is the optimizer's one
  reusable work array, held but not model state;
* **measured**: the heap held between steps (the batch, activations and gradients in
  flight freed) above its level before the model was built, less the work array;
* **formula**: bytes per parameter times the parameters; **ratio** measured / formula,
  **B/param** measured / parameters;
* **step peak**: the most the heap held during a step, above the same level: activations,
  gradients before their exchange, buffers in flight (in mixed precision, the float32
  copies the ops compute with), on top of the model state.

Then, in this process, the **activations** one rank's GPT holds after its forward (the
heap after forward above the heap before, the logits dropped: what backward will read),
with and without ``checkpoint_activations``, against the formula of the arrays mpitrain
saves (:func:`~mpitrain.cost.gpt_block_activation_bytes`, ``gpt_ends_activation_bytes``),
and the step's time both ways (medians of rounds).
"""

from __future__ import annotations

import gc
import json
import subprocess
import sys
import tracemalloc

import numpy as np

from mpitrain.bench.measure import NANOGPT, VOCAB, gpt, interleaved, seconds
from mpitrain.cluster import mpiexec
from mpitrain.comm import world
from mpitrain.cost import bytes_per_parameter, gpt_block_activation_bytes, gpt_ends_activation_bytes
from mpitrain.dtypes import dtype_of
from mpitrain.observe.memory import model_state
from mpitrain.parallel.data_parallel import DataParallel
from mpitrain.parallel.zero import Zero1, Zero2
from mpitrain.parallel.zero3 import Zero3
from mpitrain.runtime import limit_blas_threads

SYNCS = ("ddp", "zero1", "zero2", "zero3")
MAKE = {"ddp": lambda model, opt, comm: DataParallel(model, comm, optimizer=opt), "zero1": Zero1, "zero2": Zero2,
        "zero3": Zero3}  # each sync from a model, its optimizer and a communicator
PRECISIONS = ("fp32", "bf16", "fp16")  # each sync in float32 and in each mixed precision
BATCH = 12


def worker(name: str, precision: str = "fp32") -> None:
    """One rank's measurement (under mpiexec); rank 0 prints every rank's as JSON."""
    comm = world()
    dtype_of(precision)  # imports ml_dtypes for bf16 before tracing (its import is heap, not the model's)
    with limit_blas_threads(1):
        gc.collect()
        tracemalloc.start()
        base = tracemalloc.get_traced_memory()[0]
        model, opt = gpt(NANOGPT, precision)
        scale = np.float32(opt.scaler.scale if precision != "fp32" else 1.0)  # fp16's loss scale
        sync = MAKE[name](model, opt, comm)
        n = sum(p.size for p in model.parameters())
        tokens = np.random.default_rng(comm.rank).integers(0, VOCAB, (BATCH // comm.size, NANOGPT["block_size"] + 1))

        def step():
            model(tokens[:, :-1], tokens[:, 1:])[1].backward(scale)
            sync.finish()
            if precision != "fp32" and sync.optimizer.check():  # the gradients it holds: ZeRO's shards
                raise FloatingPointError("mpitrain bench memory: the gradients overflowed")
            sync.step(1e-3, 1.0)
            sync.zero_grad()

        step()
        step()  # the optimizer's state and work array exist from the first step on
        gc.collect()
        rest = tracemalloc.get_traced_memory()[0] - base
        tracemalloc.reset_peak()
        step()
        peak = tracemalloc.get_traced_memory()[1] - base
        counted = model_state(sync.model, sync.optimizer)
        tracemalloc.stop()
        sync.close()
    rows = comm.gather({"sync": name, "precision": precision, "ranks": comm.size, "rank": comm.rank, "parameters": n,
                        "rest": rest, "peak": peak, **counted})
    if comm.rank == 0:
        print(json.dumps(rows), flush=True)


def activations(rounds: int = 5, log=print) -> dict:
    """Activations held after forward, plain and checkpointed, against the formula; step
    times side by side (one process, one BLAS thread)."""
    B, V = BATCH, VOCAB
    T, L, H, C = (NANOGPT[k] for k in ("block_size", "n_layer", "n_head", "n_embd"))
    ends = gpt_ends_activation_bytes(B, T, C, V, 4)
    out = {}
    with limit_blas_threads(1):
        tokens = np.random.default_rng(0).integers(0, V, (B, T + 1))
        steps = {}
        for ckpt in (False, True):
            model, opt = gpt(checkpoint_activations=ckpt)
            model(tokens[:, :-1], tokens[:, 1:])  # caches filled before tracing
            gc.collect()
            tracemalloc.start()
            before = tracemalloc.get_traced_memory()[0]
            loss = model(tokens[:, :-1], tokens[:, 1:])[1]  # the logits dropped at once
            gc.collect()
            held = tracemalloc.get_traced_memory()[0] - before
            tracemalloc.stop()
            loss.backward()
            opt.zero_grad()

            def step(model=model, opt=opt):
                model(tokens[:, :-1], tokens[:, 1:])[1].backward()
                opt.step()
                opt.zero_grad()

            steps[ckpt] = step
            formula = ends + L * gpt_block_activation_bytes(B, T, C, H, 4, checkpointed=ckpt)
            out["checkpointed" if ckpt else "plain"] = {"held": held, "formula": formula}
        times = interleaved(steps, rounds, seconds)
    cost = float(np.median(np.divide(times[True], times[False])))
    out["step_ms"] = {k: 1e3 * float(np.median(v)) for k, v in (("plain", times[False]), ("checkpointed", times[True]))}
    log(f"activations held after forward (GPT {L}L/{H}H/{C}C, B={B} T={T}, float32), MB:")
    for name in ("plain", "checkpointed"):
        r = out[name]
        log(f"  {name:12s} measured {r['held'] / 1e6:7.3f}  formula {r['formula'] / 1e6:7.3f}  "
            f"ratio {r['held'] / r['formula']:.3f}  step {out['step_ms'][name]:6.1f} ms")
    log(f"  checkpointing keeps {out['checkpointed']['held'] / out['plain']['held']:.2f} of the activations "
        f"for x{cost:.2f} the step time (one more forward of each block)")
    out["cost"] = cost
    return out


def run(ranks=(1, 2, 4), syncs=SYNCS, precisions=PRECISIONS, as_json: bool = False, log=print) -> list[dict]:
    """Measure every sync at every rank count (each its own ``mpiexec``), in float32 and,
    in each mixed precision; print the table."""
    rows = []
    for P in ranks:
        for name in syncs:
            for precision in precisions:
                cmd = [mpiexec(), "-n", str(P), sys.executable, "-m", "mpitrain.bench.memory", name, precision]
                done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
                if done.returncode != 0:
                    raise SystemExit(f"mpitrain bench memory: {name} in {precision} on {P} rank(s) failed:\n"
                                     f"{done.stderr[-2000:]}")
                rows += json.loads(done.stdout.strip().splitlines()[-1])
    if as_json:
        log(json.dumps(rows))
    else:
        _table(rows, log)
    return rows


def _table(rows: list[dict], log) -> None:
    log("mpitrain bench memory: GPT 4L/4H/128C, AdamW; MB per rank (the largest rank's)")
    log(f"{'sync':6s} {'prec':4s} {'P':>2s} | {'params':>7s} {'grads':>7s} {'optim':>7s} {'work':>6s} | "
        f"{'measured':>8s} {'formula':>8s} {'ratio':>6s} | {'B/param':>7s} | {'step peak':>9s}")
    keys = {(r["ranks"], r["sync"], r["precision"]) for r in rows}
    for key in sorted(keys, key=lambda k: (k[0], SYNCS.index(k[1]), PRECISIONS.index(k[2]))):
        P, name, precision = key
        top = max((r for r in rows if (r["ranks"], r["sync"], r["precision"]) == key), key=lambda r: r["rest"])
        n = top["parameters"]
        measured = top["rest"] - top["work_bytes"]
        formula = bytes_per_parameter(name, P, mixed=precision != "fp32") * n
        log(f"{name:6s} {precision:4s} {P:2d} | {top['param_bytes'] / 1e6:7.3f} {top['grad_bytes'] / 1e6:7.3f} "
            f"{top['optim_bytes'] / 1e6:7.3f} {top['work_bytes'] / 1e6:6.3f} | {measured / 1e6:8.3f} "
            f"{formula / 1e6:8.3f} {measured / formula:6.3f} | {measured / n:7.2f} | {top['peak'] / 1e6:9.3f}")


if __name__ == "__main__":
    worker(*sys.argv[1:])
