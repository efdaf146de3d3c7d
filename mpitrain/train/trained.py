"""Using a trained run: :func:`load` puts the weights of a run's checkpoint (saved by any
layout: ddp, ZeRO, parameter servers, pipeline stages, tensor slices) into the whole
model, on one process or on the data-parallel ranks of ``mpiexec``; :func:`serve` draws
text from a GPT (with a key-value cache, over tensor- and data-parallel ranks:
:mod:`mpitrain.train.sampling`), :func:`evaluate` scores a split as the run did. ``mpitrain sample`` and
``mpitrain eval`` are these.

A checkpoint holds whole arrays whatever layout wrote it (:mod:`mpitrain.checkpoint`), so
loading needs no knowledge of that layout: the run is built from the saved config with
its ``parallel`` table left at the defaults (replicas of the whole model), one
micro-batch and no run directory (nothing is written), and only the model's arrays are
read.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import numpy as np

from mpitrain import checkpoint, config, ops
from mpitrain.config import ConfigError, check_ranks
from mpitrain.observe.metrics import MetricsLog
from mpitrain.runtime import blas_threads, limit_blas_threads
from mpitrain.train import evaluate as scoring
from mpitrain.train import resume, sampling
from mpitrain.train.build import Run, build_run
from mpitrain.train.report import Result

LAYOUT_FREE = {"train": {"micro_batches": 1}, "run": {"dir": ""}}  # set in the saved config; parallel: the defaults


def load(target, comm, log, overrides: list[str] = (), warn=None) -> tuple[Run, int, Path]:
    """(the run built with the weights of ``target``, the checkpoint's step, the file):
    ``target`` is a checkpoint file, or a run directory (its newest checkpoint whose
    every byte verifies; ``warn`` is told of each newer one passed over). ``overrides``:
    ``--set`` changes to the saved config (say, where the data is now). Collective over
    ``comm``."""
    cfg, path, attrs = saved_config(target, overrides, comm.agree, warn)
    run = build_run(cfg, comm, check_ranks(cfg, comm.size), log)
    with run.role.sync.whole_model(masters=True):  # a mixed-precision run's are float32
        checkpoint.restore(path, model=run.model, optimizer=run.optimizer, sync=run.role.sync, comm=comm,
                           layout=run.layout, weights_only=True)
    return run, int(attrs["step"]), path


def saved_config(target, overrides: list[str] = (), agree=lambda fn, *args: fn(*args), warn=None) -> tuple:
    """(the config of ``target`` laid out as :func:`load` builds it, its checkpoint file,
    the file's verified attributes): ``target`` a checkpoint file or a run directory (its
    newest checkpoint whose every byte verifies, each newer one passed over told to
    ``warn``), read through ``agree`` (a communicator's: every rank reads, and gets the
    answer or the same error)."""
    target = Path(target)
    target = checkpoint.run_holding(target) or target  # RUN/checkpoints: the run
    if target.is_dir():
        path, attrs, passed = agree(resume.newest, target)
        for why in passed if warn is not None else ():
            warn(f"warning: not read: {why}; reading {path}, the newest checkpoint that verifies")
    elif target.is_file():
        path, attrs = target, agree(checkpoint.check, target)
    else:
        raise ConfigError(f"{target}: no such run directory or checkpoint file")
    saved = attrs["json"]["config"]
    plain = {section: {**table, **LAYOUT_FREE.get(section, {})} for section, table in saved.items()}
    plain["parallel"] = {}  # replicas of the whole model
    plain["data"] = elsewhere(plain.get("data", {}), overrides)
    return config.from_saved(plain, list(overrides), where=f"{path}: the saved config"), path, attrs


def elsewhere(data: dict, overrides) -> dict:
    """A saved ``data`` table with ``overrides`` in mind: ``--set data.path=DIR`` (another
    dataset of the vocabulary, or the same one moved) replaces a saved ``data.name``, and
    ``--set data.name=NAME`` a saved ``data.path`` (the config takes one of them)."""
    given = {o.split("=", 1)[0].strip() for o in overrides}
    drop = {"data.path": "name", "data.name": "path"}
    return {k: v for k, v in data.items() if not any(g in given and k == f for g, f in drop.items())}


def built(path, comm, log, overrides: list[str] = ()) -> Run:
    """The run of the config at ``path`` with the weights its seed draws, laid out as
    :func:`load` lays a checkpoint's out (nothing read or written but the data)."""
    raw = config.read(path)
    plain = {section: {**raw.get(section, {}), **LAYOUT_FREE.get(section, {})} for section in {*raw, *LAYOUT_FREE}}
    plain["parallel"] = {}
    cfg = config.from_dict(plain, list(overrides))
    return build_run(cfg, comm, check_ranks(cfg, comm.size), log)


def opening(run: Run, n: int) -> np.ndarray:
    """The first ``n`` ids of the validation split (a prompt of ``n`` tokens)."""
    split = run.data.split("val")
    ids = np.empty(n, dtype=split.x_dtype)
    split.read("x", 0, n, ids)
    return ids.astype(np.int64)


@contextlib.contextmanager
def as_the_run_ran(run: Run, ranks_on_node: int = 1):
    """The run's BLAS threads per rank and fast paths, as :func:`mpitrain.train.train` sets
    them: without a limit each of ``ranks_on_node`` ranks would start a BLAS thread per
    core, and they would take turns on the cores (ten times slower here)."""
    with limit_blas_threads(blas_threads(run.cfg.train.threads, ranks_on_node)), ops.fast_paths(
            run.cfg.train.fast_paths):
        yield


def prompts_of(run: Run, prompt: str | None, prompt_file: str | None, batch: int) -> list:
    """The request's prompts as ids: ``prompt`` repeated ``batch`` times, or each line of
    ``prompt_file``, or (neither) the first character of the validation split, as the
    run's own sample begins."""
    if run.data.kind != "text":
        raise ConfigError(f"{run.data.name} is an image dataset: sample draws text from a GPT run "
                          "(mpitrain eval scores this one)")
    if prompt is not None and prompt_file is not None:
        raise ConfigError("--prompt and --prompt-file: give one of them")
    if prompt_file is not None:
        if batch != 1:
            raise ConfigError(f"--batch {batch} repeats --prompt; with --prompt-file each line is a prompt")
        return [_encoded(run, line, f"{prompt_file}:{n}") for n, line in enumerate(_lines(prompt_file), 1)]
    if prompt:
        return [_encoded(run, prompt, "--prompt")] * batch
    ids = np.empty(1, dtype=run.data.split("val").x_dtype)
    run.data.split("val").read("x", 0, 1, ids)
    return [ids.astype(np.int64)] * batch


def _lines(path: str) -> list[str]:
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().split("\n")
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"--prompt-file {path}: {e.strerror if isinstance(e, OSError) else e}") from None
    if lines and lines[-1] == "":
        lines.pop()  # the newline that ends the last line
    if not lines:
        raise ConfigError(f"--prompt-file {path}: no prompt in it (one a line)")
    return lines


def _encoded(run: Run, text: str, where: str) -> np.ndarray:
    if not text:
        raise ConfigError(f"{where}: an empty prompt (a prompt needs one character at least)")
    try:
        return run.data.encode(text).astype(np.int64)
    except ValueError as e:
        raise ConfigError(f"{where}: {e}") from None


def serve(run: Run, comm, prompts: list, tokens: int, *, temperature: float = 0.8, top_k: int | None = None,
          seed: int = 1337, tp: int = 1, dp: int | None = None, cache: bool = True, stop=None,
          progress=None, measure_peak: bool = True) -> tuple[list | None, dict]:
    """(rank 0: each prompt's text with its new characters, in order; else None, the
    figures of :func:`mpitrain.train.sampling.figures`): ``tokens`` characters drawn after
    each of ``prompts`` over ``comm``'s ranks, ``tp`` to a model sliced as tensor-parallel
    training slices it and ``dp`` groups of them, each a consecutive share of the prompts.
    ``stop()``, ``progress``: :func:`~mpitrain.train.sampling.generate`'s (``stop`` is
    agreed over every rank)."""
    from mpitrain.nn import lora

    tp, dp = _grid(comm.size, tp, dp, len(prompts))
    draws = {"temperature": temperature, "top_k": top_k, "seed": seed, "cache": cache}
    with lora.merged(run.model):  # a fine-tune's adapters folded into its weights (before any slicing)
        return _serve(run, comm, prompts, tokens, tp, dp, draws, stop, progress, measure_peak)


def _serve(run: Run, comm, prompts: list, tokens: int, tp: int, dp: int, draws: dict, stop, progress,
           measure_peak: bool) -> tuple[list | None, dict]:
    """:func:`serve` on the model as the run holds it (adapters merged); ``draws``:
    :func:`~mpitrain.train.sampling.generate`'s options."""
    from mpitrain.parallel import tensor_parallel
    from mpitrain.parallel.tensor_parallel import gather_features

    d = comm.rank // tp
    model, gather = run.model, None
    if tp > 1:
        if not isinstance(model.head, tensor_parallel.VocabParallelHead):  # not sliced yet (by an earlier call)
            try:
                tensor_parallel.slice_gpt(model, comm.split(d, comm.rank))
            except ValueError as e:
                raise ConfigError(f"--tp {tp}: {e}") from None
        tp_comm = model.head.comm
        gather = lambda logits: gather_features(logits, tp_comm)  # noqa: E731
    lo, hi = tensor_parallel.shard(len(prompts), dp, d)
    agreed = None if stop is None else (lambda: _agree(comm, stop()))
    model.eval()
    with as_the_run_ran(run, comm.node_size()):
        out = sampling.generate(model, prompts[lo:hi], tokens, block_size=run.cfg.model.block_size, first=lo,
                                gather=gather, stop=agreed, progress=progress if comm.rank == 0 else None, **draws)
        peak = _traced_peak(model, out, gather) if draws["cache"] and measure_peak else None
    leader = comm.rank % tp == 0  # each group's first rank speaks for it (its others drew the same)
    groups = comm.gather(out if leader else None)
    peaks = comm.gather(peak)
    if comm.rank != 0:
        return None, {"stopped": out.stopped}
    gens = [g for g in groups if g is not None]
    texts = [run.data.decode(np.asarray(s)) for g in gens for s in g.sequences]
    top = None if peak is None else max(peaks)
    return texts, sampling.figures(gens, len(prompts), tp, dp, top)


def _grid(ranks: int, tp: int, dp: int | None, prompts: int) -> tuple[int, int]:
    if ranks % tp:
        how = f"mpiexec -n {tp} mpitrain sample ..." if ranks == 1 else f"a multiple of {tp} ranks"
        raise ConfigError(f"--tp {tp}: the {ranks} rank(s) of this job do not divide by it (run it on {how})")
    if dp is not None and dp * tp != ranks:
        raise ConfigError(f"--dp {dp}: tp {tp} x dp {dp} = {tp * dp}, but there are {ranks} rank(s): the grid "
                          "must use every one")
    dp = ranks // tp
    if prompts < dp:
        raise ConfigError(f"{dp} data-parallel group(s) but {prompts} prompt(s): each group needs one at least "
                          "(--batch N, more lines in --prompt-file, or fewer ranks)")
    return tp, dp


def _agree(comm, mine: bool) -> bool:
    """True on every rank if any rank's ``mine`` is."""
    flag = np.array([1.0 if mine else 0.0])
    comm.allreduce(flag, op="max")
    return bool(flag[0])


def _traced_peak(model, out, gather) -> int | None:
    """The bytes a rank holds at its peak while it draws: its weights, and (``tracemalloc``)
    the cache and the work arrays of the prefill and one decode step again, replayed on a
    fresh cache (tracing would slow the timed steps)."""
    import tracemalloc

    from mpitrain.nn import kv_cache
    from mpitrain.observe.memory import model_state

    weights = model_state(model, None)["param_bytes"]
    if tracemalloc.is_tracing():
        return None
    prompts = [s[:n] for s, n in zip(out.sequences, out.prompt_lengths)]
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        kv = kv_cache.KVCache.for_model(model, len(prompts), out.capacity)
        kv_cache.prefill(model, *kv_cache.windows(prompts, out.capacity), kv, gather)
        if out.new_tokens > 1:
            grown = [s[: n + 1] for s, n in zip(out.sequences, out.prompt_lengths)]
            kv_cache.next_logits(model, grown, kv, out.capacity, gather)
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    return weights + peak


def evaluate(run: Run, step: int, comm, log, split: str | None = None) -> dict:
    """Score the loaded model on ``split`` (None: the split the run scored) over
    ``comm``, as the run did at ``step``: the same windows or images, the same
    ``train.eval_batches``; the figures, also printed through ``log`` as the run prints them."""
    split = split or scoring.SPLITS[run.data.kind]
    run.data.split(split)  # a split the dataset lacks: one message naming the ones it has
    result = Result()
    with run.role.sync.whole_model(), as_the_run_ran(run, comm.node_size()):
        scoring.score(run, comm, step, result, MetricsLog(None), log, split)
    figures = {"step": step, "split": split}
    if run.data.kind == "text":
        return {**figures, "loss": result.val_loss}
    return {**figures, "loss": result.test_loss, "accuracy": result.test_accuracy, "flip": run.cfg.train.eval_flip}
