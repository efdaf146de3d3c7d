"""``mpitrain plan --largest``: the largest model of a family that fits a cluster and a layout.

A model grows as its family does or in one dimension. ``both`` (the default) widens it a
head at a time, its heads as wide as the named model's, and deepens it in the named model's
proportion of layers to width (GPT-3's family, Brown et al. 2020, table 2.1, keeps heads of
128 and grows depth and width together); ``width`` adds heads only; ``depth`` adds layers
only. A width keeps the named model's MLP in proportion (``model.ffn_hidden``) and its key
and value heads (``model.n_kv_head``: Llama's family keeps 8), so heads come in steps that
divide among them and among the tensor slices; depth gives each pipeline stage (and each
chunk of it) a layer at least. Each candidate is planned whole (:func:`mpitrain.plan.make`,
the trainer's checks included), and the largest whose every rank fits its memory is kept:
a bisection over the one number that grows it (heads, or layers), which every rank's memory
grows with. The smallest is refused as the layout itself would be, naming the field.
"""

from __future__ import annotations

import dataclasses
import math

from mpitrain.cli_common import DOES_NOT_FIT
from mpitrain.config import ConfigError

HOW = ("both", "width", "depth")


def grid(cfg, ranks: int) -> tuple[int, int, int]:
    """(dp, pp, tp) of ``cfg`` on ``ranks``, "the rest" (-1) resolved as the trainer resolves it;
    where it refuses, the sizes given (the smallest model's plan then says why)."""
    from mpitrain.config import check_ranks

    try:
        return check_ranks(cfg, ranks)
    except ConfigError:
        return tuple(max(1, getattr(cfg.parallel, n)) for n in ("dp", "pp", "tp"))


def grouped(model) -> bool:
    """Whether ``model`` has fewer key and value heads than query heads (grouped-query attention)."""
    return 0 < model.n_kv_head < model.n_head


def shape(model, k: int, how: str, least: int = 1) -> dict:
    """The model fields of step ``k`` of growing ``model`` (a config's ``[model]``) ``how``,
    with ``least`` layers at least."""
    width = model.n_embd // model.n_head  # a head's
    if how == "depth":
        return {"n_layer": k}
    wide = {"n_head": k, "n_embd": k * width}
    if model.n_kv_head and not grouped(model):  # a head of keys and values for each, said: so it stays
        wide["n_kv_head"] = k
    if model.ffn_hidden:  # the MLP as wide as the named model's in proportion to the width
        wide["ffn_hidden"] = round(model.ffn_hidden * k / model.n_head)
    if how == "width":
        return wide
    return {"n_layer": max(least, round(k * width * model.n_layer / model.n_embd)), **wide}


def largest(cfg, ranks: int, machine, data, how: str = "both", limit: int = 1 << 14):
    """(the plan of the largest model grown from ``cfg``'s that fits ``machine``'s memory
    on every rank, or None where even the smallest does not; the plan of the next step up,
    which does not fit, or None where it is refused or beyond ``limit`` steps). A
    ConfigError where the smallest is refused: the layout's, not a size's."""
    from mpitrain import plan as planner
    from mpitrain.plan.layout import model_chunks

    _, pp, tp = grid(cfg, ranks)
    least = pp * model_chunks(cfg.parallel, pp)  # a layer in each stage's chunk at least
    # whole heads on every slice, and in every group of a key-value head
    step = math.lcm(tp, cfg.model.n_kv_head if grouped(cfg.model) else 1) if how != "depth" else 1
    first = least if how == "depth" else step

    def made(k: int):
        model = dataclasses.replace(cfg.model, **shape(cfg.model, k, how, least))
        return planner.make(dataclasses.replace(cfg, model=model), ranks, machine, data)

    def planned(k: int):
        try:
            return made(k)
        except ConfigError:  # a size the trainer refuses beyond the smallest: the edge of the growth
            return None

    def fits(plan) -> bool:
        return plan is not None and plan.largest().peak <= machine.memory

    low = made(first)
    if not fits(low):
        return None, low
    k, high = first, None
    while k * 2 <= limit:  # doubling until a size does not fit
        high = planned(k * 2)
        if not fits(high):
            break
        k, low, high = k * 2, high, None
    top = 2 * k if high is not None else min(limit, 2 * k)
    while top - k > step:  # the largest multiple of step that fits, between k (fits) and top (does not)
        mid = k + (top - k) // (2 * step) * step
        plan = planned(mid)
        if fits(plan):
            k, low = mid, plan
        else:
            top, high = mid, plan
    return low, high


def run(args) -> int:
    """What ``mpitrain plan --largest`` prints: the grown model, what it assumes, its plan,
    and the time to train it for each of ``--train-tokens``."""
    from mpitrain.plan import machine_of, models, show
    from mpitrain.plan.data import resolve

    cfg, data, source = models.config_of(args)
    if cfg.model.name != "gpt":
        raise ConfigError(f"--largest: grows a GPT (its heads and layers); model.name is {cfg.model.name!r}")
    step = cfg.train.global_batch_size * cfg.model.block_size  # tokens
    for n in args.train_tokens or ():
        if n < step:
            raise ConfigError(f"--train-tokens {n:,.3g}: fewer than one step's {step:,} tokens")
    ranks, machine = machine_of(args)
    best, above = largest(cfg, ranks, machine, data or resolve(cfg), args.largest)
    m = cfg.model
    grows = {"both": f"in width (heads of {m.n_embd // m.n_head}) and depth ({m.n_layer} layers to {m.n_embd} wide, "
                     "as its family grows)", "width": "in width (whole heads)", "depth": "in depth"}[args.largest]
    if best is None:
        lay = above.layout
        print(f"largest: {source} grown {grows}: even its smallest step ({lay.cfg.model.n_layer} layers x "
              f"{lay.cfg.model.n_embd} wide) does not fit {show.size(machine.memory)} per rank on {ranks} rank(s): "
              f"it needs {show.size(above.largest().peak)} with micro-batches of {lay.micro_batch} x {lay.T} tokens "
              "(more micro-batches, train.micro_batches, or a smaller train.global_batch_size hold fewer activations)"
              + ("; no page written" if getattr(args, "html", None) else ""))
        return DOES_NOT_FIT
    lay, bm = best.layout, best.layout.cfg.model
    line = (f"largest: {source} grown {grows}: {bm.n_layer} layers x {bm.n_embd} wide ({bm.n_head} heads), "
            f"{lay.whole / 1e9:,.3g} B parameters; its largest rank peaks at {show.size(best.largest().peak)} of "
            f"{show.size(machine.memory)}")
    if above is not None:
        am = above.layout.cfg.model
        line += (f"; the next ({am.n_layer} x {am.n_embd}, {above.layout.whole / 1e9:,.3g} B) needs "
                 f"{show.size(above.largest().peak)}")
    t = lay.cfg.train
    room = ("for the model state, the activations and a GPU framework's allowance (the CUDA context, NCCL's "
            "buffers, cuBLAS's workspace, 5% temporaries; no allocator fragmentation)" if lay.textbook else
            "for everything the plan counts (mpitrain's NumPy heap, as --validate holds it)")
    kept = "".join([f"; the MLP {bm.ffn_hidden / bm.n_embd:.3g} x the width" if m.ffn_hidden else "",
                    f"; {m.n_kv_head} key and value heads" if grouped(m) else ""])
    assumed = (f"assumes: {lay.describe()}{kept}; {cfg.optim.name}; micro-batches of {lay.micro_batch} x "
               f"{lay.T} tokens; {show.size(machine.memory)} per rank {room}"
               f"{'; mixed precision keeps float32 masters' if t.precision != 'fp32' else ''}")
    lines = [line, assumed, show.text(best, source, memory=args.hardware != "this" or args.memory_table,
                                      tiers=args.tiers)]
    tokens = t.global_batch_size * lay.T
    for n in args.train_tokens or ():
        seconds = n / tokens * best.time["step"]
        lines.append(f"to train it on {n:,.3g} tokens: {n / tokens:,.0f} steps of {tokens:,} tokens, "
                     f"{show.sig(seconds / 86400)} days on these {ranks} rank(s); {6 * lay.whole * n:.3g} FLOPs at "
                     "6 N D")
    print("\n".join(lines))
    if getattr(args, "html", None):  # the grown model's plan as a page, what it assumes above it
        from mpitrain.plan import page

        print(f"wrote {page.write(args.html, best, chr(10).join(lines), f'mpitrain plan --largest: {source}')}")
    return 0
