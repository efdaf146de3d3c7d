"""Using a trained run: :func:`load` puts the weights of a run's checkpoint (saved by any
layout: ddp, ZeRO, parameter servers, pipeline stages, tensor slices) into the whole
model, on one process or on the data-parallel ranks of ``mpiexec``; :func:`sample` draws
text from a GPT, :func:`evaluate` scores a split as the run did. ``mpitrain sample`` and
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
from mpitrain.train import resume
from mpitrain.train.build import Run, build_run
from mpitrain.train.report import Result

LAYOUT_FREE = {"train": {"micro_batches": 1}, "run": {"dir": ""}}  # set in the saved config; parallel: the defaults


def load(target, comm, log, overrides: list[str] = ()) -> tuple[Run, int, Path]:
    """(the run built with the weights of ``target``, the checkpoint's step, the file):
    ``target`` is a checkpoint file, or a run directory (its newest checkpoint whose
    every byte verifies). ``overrides``: ``--set`` changes to the saved config (say, where
    the data is now). Collective over ``comm``."""
    target = Path(target)
    if target.is_dir():
        path, attrs = comm.agree(resume.newest, target)
    elif target.is_file():
        path, attrs = target, comm.agree(checkpoint.check, target)
    else:
        raise ConfigError(f"{target}: no such run directory or checkpoint file")
    saved = attrs["json"]["config"]
    plain = {section: {**table, **LAYOUT_FREE.get(section, {})} for section, table in saved.items()}
    plain["parallel"] = {}  # replicas of the whole model
    cfg = config.from_saved(plain, list(overrides), where=f"{path}: the saved config")
    run = build_run(cfg, comm, check_ranks(cfg, comm.size), log)
    with run.role.sync.whole_model(masters=True):  # a mixed-precision run's are float32
        checkpoint.restore(path, model=run.model, optimizer=run.optimizer, sync=run.role.sync, comm=comm,
                           layout=run.layout, weights_only=True)
    return run, int(attrs["step"]), path


@contextlib.contextmanager
def as_the_run_ran(run: Run, ranks_on_node: int = 1):
    """The run's BLAS threads per rank and fast paths, as :func:`mpitrain.train.train` sets
    them: without a limit each of ``ranks_on_node`` ranks would start a BLAS thread per
    core, and they would take turns on the cores (ten times slower here)."""
    with limit_blas_threads(blas_threads(run.cfg.train.threads, ranks_on_node)), ops.fast_paths(
            run.cfg.train.fast_paths):
        yield


def sample(run: Run, prompt: str | None, tokens: int, temperature: float, top_k: int | None, seed: int) -> str:
    """``tokens`` characters drawn after ``prompt`` (None: the first character of the
    validation split, as the run's own sample), the prompt included."""
    if run.data.kind != "text":
        raise ConfigError(f"{run.data.name} is an image dataset: sample draws text from a GPT run "
                          "(mpitrain eval scores this one)")
    if prompt:
        try:
            ids = run.data.encode(prompt)
        except ValueError as e:
            raise ConfigError(f"--prompt: {e}") from None
    else:
        ids = np.empty(1, dtype=run.data.split("val").x_dtype)
        run.data.split("val").read("x", 0, 1, ids)
    with as_the_run_ran(run):
        out = run.model.generate(ids[None, :].astype(np.int64), tokens, temperature=temperature, top_k=top_k,
                                 generator=np.random.default_rng(seed))
    return run.data.decode(out[0])


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
