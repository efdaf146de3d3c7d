"""Fine-tuning: what of a model trains (``train.trainable``) and its LoRA adapters
(``model.lora_rank``, ``lora_alpha``, ``lora_targets``; :mod:`mpitrain.nn.lora`).

A frozen parameter has ``requires_grad`` false: backward computes no gradient for it
(every op skips an input that needs none), the optimizer is built over the others, so it
has no optimizer state, and every gradient sync takes the parameters that require
gradients (:class:`mpitrain.parallel.GradSync`), so none exchanges, shards or buckets it.
A frozen parameter is held whole on every rank, ZeRO-3's too, in the training's number
format (16 bits in mixed precision: it has no float32 master). A fine-tuning run starts
from a trained run's weights with ``mpitrain train CONFIG --from CHECKPOINT``.
"""

from __future__ import annotations

from mpitrain.config import Config, ConfigError, trained_names
from mpitrain.nn import lora


def prepare(cfg: Config, model) -> None:
    """Give ``model`` the adapters of ``cfg.model`` (a GPT with ``lora_rank`` > 0) and
    freeze what ``cfg`` does not train, in place; ConfigError naming the field for a
    pattern that matches nothing."""
    m = cfg.model
    if m.name == "gpt" and m.lora_rank:
        try:
            lora.adapt(model, m.lora_targets, m.lora_rank, m.lora_alpha)
        except ValueError as e:
            raise ConfigError(f"model.lora_targets: {e}") from None
    freeze(model, trained_names(cfg, [n for n, _ in model.named_parameters()]))


def freeze(model, trained) -> None:
    """Parameters of ``model`` named in ``trained`` require gradients, the others not (a
    sliced model's parameters are new ones: it is called again after slicing)."""
    trained = set(trained)
    for name, q in model.named_parameters():
        q.requires_grad = name in trained


def trained(model) -> list:
    """The parameters of ``model`` that train."""
    return [q for q in model.parameters() if q.requires_grad]


def describe(model, cfg: Config) -> str:
    """What trains, for the run's first lines: '' when everything does."""
    params = model.parameters()
    n = sum(q.size for q in params if q.requires_grad)
    total = sum(q.size for q in params)
    if n == total:
        return ""
    m = cfg.model
    adapters = sum(q.size for name, q in model.named_parameters() if lora.is_adapter(name))
    what = (f"LoRA rank {m.lora_rank} (scale {lora.scale(m.lora_rank, m.lora_alpha):g}): {adapters:,} adapter "
            f"parameters" if adapters else "")
    chosen = f"train.trainable {list(cfg.train.trainable)}" if cfg.train.trainable else ""
    return (f"fine-tuning: {n:,} of {total:,} parameters train ({100 * n / total:.2f}%; "
            f"{'; '.join(x for x in (what, chosen) if x)}); the rest are frozen: no gradients, no optimizer state, "
            "not exchanged")
