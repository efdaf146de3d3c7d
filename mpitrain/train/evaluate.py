"""Evaluation on the held-out split, each rank of a communicator scoring its share.

Images: accuracy and mean loss over the whole test split. Text: the mean loss per token
over the validation windows (all of them, or the first ``train.eval_batches`` global
batches), read at a fixed stride of the context length, deterministically.
"""

from __future__ import annotations

import numpy as np

from mpitrain import nn, ops
from mpitrain.data import Dataset, ShardReader
from mpitrain.data.loader import normalize
from mpitrain.tensor import Tensor, no_grad

EVAL_BATCH_PER_RANK = 250  # images per rank per evaluation batch


def score(run, comm, step: int, result, metrics, log) -> None:
    """Score ``run.model`` over ``comm`` (collective), print the figure and record it in
    ``result`` and the metrics file."""
    model, data, cfg = run.model, run.data, run.cfg
    if data.kind == "text":
        result.val_loss = evaluate_text(model, data, cfg, comm)
        log(f"step {step}: val loss {result.val_loss:.4f}")
    else:
        result.test_accuracy, result.test_loss = evaluate_images(model, data, cfg, comm)
        log(f"step {step}: test accuracy {100 * result.test_accuracy:.2f}%, test loss {result.test_loss:.4f}")
    record = {"step": step, "val_loss": result.val_loss, "test_accuracy": result.test_accuracy}
    result.history.append(record)
    metrics.write("eval", test_loss=result.test_loss, **record)


def evaluate_images(model: nn.Module, data: Dataset, cfg, comm) -> tuple[float, float]:
    """(accuracy, mean loss) on the whole test split, each rank scoring its share."""
    split = data.split("test")
    reader = ShardReader(split, rank=comm.rank, size=comm.size, global_batch=EVAL_BATCH_PER_RANK * comm.size,
                         seed=cfg.train.seed, shuffle=False, drop_last=False, prefetch=1)
    model.eval()
    correct, total_loss, n = 0, 0.0, 0
    with no_grad():
        for batch in reader.epoch(0):
            if not len(batch.y):
                continue
            logits = model(Tensor(normalize(batch.x, data.mean, data.std, cfg.train.dtype)))
            total_loss += ops.cross_entropy(logits, batch.y, reduction="sum").item()
            correct += int((logits.data.argmax(axis=-1) == batch.y).sum())
            n += len(batch.y)
    model.train()
    sums = np.sum(comm.allgather((correct, total_loss, n)), axis=0)
    return sums[0] / sums[2], sums[1] / sums[2]


def evaluate_text(model: nn.Module, data: Dataset, cfg, comm) -> float:
    """Mean loss per token over the validation windows (all of them, or the first
    ``train.eval_batches`` global batches). A global batch is the training one, rounded
    up to a multiple of the ranks (parameter servers evaluate too: more ranks than the
    batch was divided for)."""
    B = -(-cfg.train.global_batch_size // comm.size) * comm.size
    reader = ShardReader(data.split("val"), rank=comm.rank, size=comm.size,
                         global_batch=B, seed=cfg.train.seed, shuffle=False,
                         drop_last=False, window=cfg.model.block_size, prefetch=1)
    limit = cfg.train.eval_batches or reader.steps_per_epoch
    model.eval()
    total, n = 0.0, 0
    with no_grad():
        for batch in reader.epoch(0):
            if batch.step >= limit:
                break
            if len(batch.x):
                total += model(batch.x, batch.y)[1].item() * len(batch.x)
                n += len(batch.x)
    model.train()
    sums = np.sum(comm.allgather((total, n)), axis=0)
    return sums[0] / sums[1]
