"""The training loop: build data, model and optimizer from a Config, train, evaluate.

One process here; the parallel strategies wrap the same pieces. The loop per step:
draw the batch, forward, backward, optional global-norm clipping, set the scheduled
learning rate, optimizer step, zero the gradients. Progress lines report loss, learning
rate, samples/s and achieved GFLOP/s (FLOPs counted from the model's shapes on the
first step, see :mod:`mpitrain.observe.flops`).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

import numpy as np

from mpitrain import nn, ops, optim, rng
from mpitrain.runtime import blas_threads, limit_blas_threads, tune_allocator
from mpitrain.config import Config, ConfigError
from mpitrain.data import ImageBatches, TextBatches, mnist5k, shakespeare, text_file
from mpitrain.data.loader import SAMPLING
from mpitrain.observe.flops import FlopCount
from mpitrain.tensor import Tensor, default_dtype, no_grad, observe_ops


# ---------------------------------------------------------------- building
def load_data(cfg: Config):
    d = cfg.data
    if d.name == "mnist5k":
        return mnist5k()
    if d.name == "shakespeare":
        return shakespeare(d.val_fraction)
    return text_file(d.path, d.val_fraction)


def check_config_against_data(cfg: Config, data) -> None:
    """The checks that need the data: raise ConfigError naming the field."""
    if cfg.model.name == "gpt":
        shortest = min(len(data.train), len(data.val))
        if cfg.model.block_size + 1 > shortest:
            raise ConfigError(f"model.block_size: windows of block_size + 1 = {cfg.model.block_size + 1} "
                              f"tokens do not fit the {shortest}-token split of {data.name}")
        return
    n = len(data.x_train)
    if cfg.train.global_batch_size > n:
        raise ConfigError(f"train.global_batch_size: must be at most the {n} training images of "
                          f"{data.name}, got {cfg.train.global_batch_size}")
    _, h, w, _ = data.x_train.shape
    if h != w:
        raise ConfigError(f"data.name: the CNNs expect square images, {data.name} has {h}x{w}")


def build_model(cfg: Config, data) -> nn.Module:
    """The model of ``cfg.model`` for ``data``, initialised from the global seed."""
    m = cfg.model
    with default_dtype(cfg.train.dtype):
        if m.name == "gpt":
            gcfg = nn.GPTConfig(vocab_size=len(data.vocab), block_size=m.block_size, n_layer=m.n_layer,
                                n_head=m.n_head, n_embd=m.n_embd, dropout=m.dropout, bias=m.bias,
                                checkpoint_activations=m.checkpoint_activations)
            return nn.GPT(gcfg)
        _, h, _, c = data.x_train.shape
        kinds = {"lenet": lambda: nn.LeNet(c, h, len(data.classes), m.channels, m.hidden, m.dropout),
                 "convnet": lambda: nn.ConvNet(c, h, len(data.classes), m.channels),
                 "resnet": lambda: nn.ResNet(c, h, len(data.classes), m.widths, m.blocks)}
        return kinds[m.name]()


def build_optimizer(cfg: Config, model: nn.Module) -> optim.Optimizer:
    o = cfg.optim
    groups = optim.decay_groups(model.named_parameters(), o.weight_decay)
    if o.name == "sgd":
        return optim.SGD(groups, o.lr, momentum=o.momentum, nesterov=o.nesterov)
    cls = optim.AdamW if o.name == "adamw" else optim.Adam
    return cls(groups, o.lr, betas=o.betas, eps=o.eps)


def build_schedule(cfg: Config, total_steps: int):
    o = cfg.optim
    if o.schedule == "constant":
        return optim.Constant(o.lr, o.warmup_steps)
    return optim.WarmupCosine(o.lr, min(o.warmup_steps, total_steps), total_steps, o.min_lr)


# ------------------------------------------------------------------ steps
def image_loss(model: nn.Module, x: np.ndarray, y: np.ndarray) -> Tensor:
    return ops.cross_entropy(model(Tensor(x)), y)


def text_loss(model: nn.Module, x: np.ndarray, y: np.ndarray) -> Tensor:
    return model(x, y)[1]


def train_step(model: nn.Module, opt: optim.Optimizer, loss_fn, x, y, lr: float, grad_clip: float) -> float:
    """One optimizer step on one batch; returns the loss."""
    loss = loss_fn(model, x, y)
    loss.backward()
    if grad_clip > 0:
        optim.clip_grad_norm(model.parameters(), grad_clip)
    opt.set_lr(lr)
    opt.step()
    opt.zero_grad()
    return loss.item()


def evaluate_images(model: nn.Module, batches: ImageBatches) -> tuple[float, float]:
    """(accuracy, mean loss) on the test split."""
    model.eval()
    correct, total_loss, n = 0, 0.0, 0
    with no_grad():
        for x, y in batches.test_batches():
            logits = model(Tensor(x))
            total_loss += ops.cross_entropy(logits, y, reduction="sum").item()
            correct += int((logits.data.argmax(axis=-1) == y).sum())
            n += len(y)
    model.train()
    return correct / n, total_loss / n


def evaluate_text(model: nn.Module, batches: TextBatches, count: int) -> float:
    """Mean validation loss over ``count`` fixed batches of windows."""
    model.eval()
    with no_grad():
        losses = [text_loss(model, x, y).item() for x, y in batches.val_batches(count)]
    model.train()
    return float(np.mean(losses))


# ------------------------------------------------------------------- loop
@dataclass
class Result:
    steps: int = 0
    seconds: float = 0.0  # wall time of the loop, evaluations included
    samples_per_s: float = 0.0  # of the training steps alone
    gflops_per_s: float = 0.0
    final_loss: float = float("nan")
    test_accuracy: float | None = None
    test_loss: float | None = None
    val_loss: float | None = None
    sample: str | None = None
    history: list = field(default_factory=list)


def train(cfg: Config, log=print) -> Result:
    """Train as ``cfg`` says, printing progress through ``log``; returns the figures."""
    t = cfg.train
    threads = blas_threads(t.threads)
    tune_allocator()
    with limit_blas_threads(threads):
        data = load_data(cfg)
        check_config_against_data(cfg, data)
        rng.manual_seed(t.seed)
        model = build_model(cfg, data)
        opt = build_optimizer(cfg, model)
        is_text = cfg.model.name == "gpt"
        B = t.global_batch_size
        if is_text:
            batches = TextBatches(data, B, cfg.model.block_size, t.seed)
            total = t.steps
            loss_fn = text_loss
        else:
            batches = ImageBatches(data, B, t.seed, t.dtype, cfg.data.shift)
            total = t.steps or t.epochs * batches.steps_per_epoch
            loss_fn = image_loss
        schedule = build_schedule(cfg, total)
        log(f"model {cfg.model.name}: {model.num_parameters():,} parameters; data {data.name}; "
            f"{total} steps of {B} samples; {threads} BLAS thread(s); {t.dtype}")
        return _loop(cfg, model, opt, schedule, batches, loss_fn, total, log)


def _batches(batches, is_text: bool, total: int):
    """(epoch, step, x, y) for every training step."""
    step = 0
    epoch = 0
    while step < total:
        if is_text:
            x, y = batches.batch(step)
            yield 0, step, x, y
            step += 1
            continue
        for x, y in batches.epoch(epoch):
            if step >= total:
                return
            yield epoch, step, x, y
            step += 1
        epoch += 1


def _loop(cfg: Config, model, opt, schedule, batches, loss_fn, total: int, log) -> Result:
    t, o = cfg.train, cfg.optim
    is_text = cfg.model.name == "gpt"
    result = Result()
    flops = FlopCount()
    window_loss, window_steps, window_time = 0.0, 0, 0.0
    train_seconds = 0.0  # optimizer steps only, without data and evaluation
    start = time.perf_counter()
    last_epoch = 0

    def evaluate(step: int) -> None:
        if is_text:
            result.val_loss = evaluate_text(model, batches, t.eval_batches)
            log(f"step {step}: val loss {result.val_loss:.4f}")
        else:
            result.test_accuracy, result.test_loss = evaluate_images(model, batches)
            log(f"step {step}: test accuracy {100 * result.test_accuracy:.2f}%, "
                f"test loss {result.test_loss:.4f}")
        result.history.append({"step": step, "val_loss": result.val_loss,
                               "test_accuracy": result.test_accuracy})

    for epoch, step, x, y in _batches(batches, is_text, total):
        if epoch != last_epoch and not t.eval_interval:
            evaluate(step)
        last_epoch = epoch
        lr = schedule(step)
        tick = time.perf_counter()
        with observe_ops(flops) if step == 0 else contextlib.nullcontext():
            loss = train_step(model, opt, loss_fn, x, y, lr, o.grad_clip)
        seconds = time.perf_counter() - tick
        window_time += seconds
        train_seconds += seconds
        if not np.isfinite(loss):
            raise FloatingPointError(f"loss is {loss} at step {step}; lower optim.lr or set optim.grad_clip")
        window_loss += loss
        window_steps += 1
        result.final_loss = loss
        done = step + 1
        if done % t.log_interval == 0 or done == total:
            rate = window_steps * t.global_batch_size / window_time
            gflops = window_steps * flops.total / window_time / 1e9
            log(f"step {done}/{total} | loss {window_loss / window_steps:.4f} | lr {lr:.2e} | "
                f"{rate:,.0f} samples/s | {gflops:.1f} GFLOP/s")
            window_loss, window_steps, window_time = 0.0, 0, 0.0
        if t.eval_interval and done % t.eval_interval == 0 and done != total:
            evaluate(done)

    evaluate(total)
    result.steps = total
    result.seconds = time.perf_counter() - start
    result.samples_per_s = total * t.global_batch_size / train_seconds
    result.gflops_per_s = total * flops.total / train_seconds / 1e9
    if is_text and t.sample_tokens:
        prompt = batches.data.val[None, :1]  # the first held-out character
        ids = model.generate(prompt, t.sample_tokens, temperature=0.8, top_k=None,
                             generator=np.random.default_rng((t.seed, SAMPLING)))
        result.sample = batches.data.decode(ids[0, 1:])
        log("sample:\n" + result.sample)
    log(f"done: {total} steps in {result.seconds:.1f} s; training steps {train_seconds:.1f} s, "
        f"{result.samples_per_s:,.0f} samples/s, {result.gflops_per_s:.1f} GFLOP/s")
    return result
