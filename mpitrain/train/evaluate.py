"""Evaluation on the held-out split (:func:`evaluate_images`, :func:`evaluate_text`): a
rank that holds the whole model scores its share of the communicator's; ranks that hold
parts of it score their lane's (every part of a lane sees its batches). The model's
output (images) or loss (text) comes from the role's schedule (``forward_only``,
``loss_only``: a pipeline's batch goes through the stages, and only the last one's rank
scores it; a sliced model computes its loss on every rank of its group).
"""

from __future__ import annotations

import numpy as np

from mpitrain import ops
from mpitrain.data import Dataset, ShardReader
from mpitrain.data.loader import normalize
from mpitrain.nn.lora import merged
from mpitrain.tensor import Tensor, no_grad

EVAL_BATCH_PER_RANK = 250  # images per rank per evaluation batch


SPLITS = {"text": "val", "image": "test"}  # the split a run scores, by its data's kind


def score(run, comm, step: int, result, metrics, log, split: str | None = None) -> None:
    """Score ``run.model`` over ``comm`` (collective) on ``split`` (None: the one a run
    scores, :data:`SPLITS`), print the figure and record it in ``result`` and the
    metrics file."""
    model, data, cfg, role = run.model, run.data, run.cfg, run.role
    lane = (comm.rank, comm.size) if role.grid.whole_model else role.lane
    split = split or SPLITS[data.kind]
    label = split  # the figures named by the split scored: "val loss", or "train loss" for --split train
    model.eval()
    try:
        with merged(model):  # LoRA's adapters folded into their weights: the plain layers, one product each
            if data.kind == "text":
                result.val_loss = evaluate_text(role.schedule.loss_only, data, cfg, comm, lane, split)
                log(f"step {step}: {label} loss {result.val_loss:.4f}")
            else:
                result.test_accuracy, result.test_loss = evaluate_images(role.schedule.forward_only, data, cfg, comm,
                                                                         lane, split, role.takes_input)
                views = ", each image and its mirror" if cfg.train.eval_flip else ""
                log(f"step {step}: {label} accuracy {100 * result.test_accuracy:.2f}%, {label} loss "
                    f"{result.test_loss:.4f}{views}")
    finally:
        model.train()
    record = {"step": step, "val_loss": result.val_loss, "test_accuracy": result.test_accuracy}
    result.history.append(record)
    views = {"flip": True} if cfg.train.eval_flip and data.kind == "image" else {}  # two views: never one's figure
    metrics.write("eval", test_loss=result.test_loss, **record, **views)


def evaluate_images(forward, data: Dataset, cfg, comm, lane: tuple, split: str = "test",
                    takes_input: bool = True) -> tuple[float, float]:
    """(accuracy, mean loss) on the whole ``split``, each lane scoring its share
    (``forward(x)``: the logits, or None on a rank that does not end the model; a rank
    whose model does not read the images, a pipeline's later stage, ``not takes_input``,
    gets them raw, for their count). With ``train.eval_flip``, each image's prediction is
    the mean of its and its mirror's probabilities (two views, as the training flips them)."""
    reader = ShardReader(data.split(split), rank=lane[0], size=lane[1], global_batch=EVAL_BATCH_PER_RANK * lane[1],
                         seed=cfg.train.seed, shuffle=False, drop_last=False, prefetch=1)
    correct, total_loss, n = 0, 0.0, 0
    with no_grad():
        for batch in reader.epoch(0):
            if not len(batch.y):
                continue
            x = normalize(batch.x, data.mean, data.std, cfg.train.dtype) if takes_input else batch.x  # (B, H, W, C)
            logits = forward(Tensor(x))
            if cfg.train.eval_flip:  # every stage runs both views
                mirrored = forward(Tensor(x[:, :, ::-1].copy() if takes_input else x))
            else:
                mirrored = None
            if logits is None:
                continue
            if mirrored is None:
                total_loss += ops.cross_entropy(logits, batch.y, reduction="sum").item()
                predicted = logits.data.argmax(axis=-1)
            else:
                log_p = log_mean_probabilities(logits.data, mirrored.data)  # (B, classes)
                total_loss -= log_p[np.arange(len(batch.y)), batch.y].sum()
                predicted = log_p.argmax(axis=-1)
            correct += int((predicted == batch.y).sum())
            n += len(batch.y)
    sums = np.sum(comm.allgather((correct, total_loss, n)), axis=0)
    return sums[0] / sums[2], sums[1] / sums[2]


def log_mean_probabilities(*logits: np.ndarray) -> np.ndarray:
    """(B, classes) logits of each view -> the log of the views' mean softmax, in float64."""
    z = np.stack(logits).astype(np.float64)  # (V, B, classes)
    log_p = z - z.max(axis=-1, keepdims=True)
    log_p -= np.log(np.exp(log_p).sum(axis=-1, keepdims=True))
    return np.logaddexp.reduce(log_p, axis=0) - np.log(len(logits))


def evaluate_text(loss_of, data: Dataset, cfg, comm, lane: tuple, split: str = "val") -> float:
    """Mean loss per token over ``split``'s windows, read deterministically at a fixed
    stride of the context length (all of them, or the first ``train.eval_batches`` global
    batches). A global batch is the training one, rounded up to a multiple of the lanes
    (parameter servers evaluate too: more ranks than the batch was divided for).
    ``loss_of(x, y)``: the mean loss, or None on a rank that does not end the model (a
    pipeline's other stages)."""
    B = -(-cfg.train.global_batch_size // lane[1]) * lane[1]
    reader = ShardReader(data.split(split), rank=lane[0], size=lane[1], global_batch=B, seed=cfg.train.seed,
                         shuffle=False, drop_last=False, window=cfg.model.block_size, prefetch=1)
    limit = cfg.train.eval_batches or reader.steps_per_epoch
    total, n = 0.0, 0
    with no_grad():
        for batch in reader.epoch(0):
            if batch.step >= limit:
                break
            if len(batch.x) and (loss := loss_of(batch.x, batch.y)) is not None:
                total += loss.item() * len(batch.x)
                n += len(batch.x)
    sums = np.sum(comm.allgather((total, n)), axis=0)
    return sums[0] / sums[1]
