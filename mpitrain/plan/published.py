"""Published training runs as data (``runs.toml``), each planned as its paper laid it out:
the planner's step time and peak memory per GPU beside the paper's figure. Nothing of the
planner is fitted to them; they check it.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

SHIPPED = Path(__file__).with_name("runs.toml")
MODEL = ("n_layer", "n_head", "n_embd", "block_size", "ffn_hidden", "gated_mlp", "n_kv_head", "tie_embeddings",
         "position_embedding", "bias", "dropout", "flash_attention")


def runs() -> dict:
    """{key: the run's table} of ``runs.toml``."""
    with open(SHIPPED, "rb") as f:
        return tomllib.load(f)["run"]


def args_of(run: dict) -> argparse.Namespace:
    """``mpitrain plan``'s arguments that lay ``run`` out as its paper did (its model set on
    GPT-2's reference entry, field by field)."""
    sets = {f"model.{k}": run[k] for k in MODEL if k in run}
    sets.update({"model.vocab_size": run["vocab"], "parallel.tp": run["tp"], "parallel.pp": run["pp"],
                 "train.global_batch_size": run["global_batch_size"], "train.precision": run["precision"],
                 "model.checkpoint_activations": run["recompute"] == "full",
                 "model.selective_recompute": run["recompute"] == "selective",
                 "parallel.sequence_parallel": run.get("sequence_parallel", False),
                 "train.accumulation": run.get("accumulation", "fused"),
                 "parallel.sync": run.get("sync", "ddp")})
    if run.get("ddp"):  # the framework's data parallelism: PyTorch's (25 MB buckets during backward, its
        # bucket_cap_mb default), or Megatron-LM's "local" one (one allreduce of its gradient buffer, after backward)
        sets.update({"parallel.bucket_mb": 25} if run["ddp"] == "torch" else
                    {"parallel.bucket_mb": 1e6, "parallel.progress": "off"})
    dp = run["gpus"] // (run["tp"] * run["pp"])
    sets["train.micro_batches"] = run["global_batch_size"] // (dp * run["micro_batch"])
    if run["pp"] > 1:
        sets.update({"parallel.schedule": run["schedule"], "parallel.chunks": run["chunks"]})
    nodes = math.ceil(run["gpus"] / run["per_node"])
    text = lambda v: str(v).lower() if isinstance(v, bool) else str(v)  # noqa: E731 (TOML's true/false)
    return argparse.Namespace(config=None, model="gpt2", set=[f"{k}={text(v)}" for k, v in sets.items()],
                              hardware=run["hardware"], ranks=run["gpus"], nodes=nodes, per_node=run["per_node"],
                              network=run["network"] if nodes > 1 else None, intra=None,
                              memory_per_rank=None, catalogue=None, mfu=None)


def planned(run: dict):
    """The plan of ``run``."""
    from mpitrain import plan as planner

    return planner.from_args(args_of(run))[0]


def published_step(run: dict) -> float | None:
    """The run's step in seconds as its paper gives it: ``step_s``, or its achieved
    teraFLOP/s per GPU over the FLOPs the paper counts a step
    (:func:`mpitrain.cost.recomputed_step_flops`, full recomputation); None for a run that
    did not run (it did not fit)."""
    if "step_s" in run or "tflops" not in run:
        return run.get("step_s")
    from mpitrain import cost

    flops = cost.recomputed_step_flops(run["global_batch_size"], run["block_size"], run["n_embd"], run["n_layer"],
                                       run["vocab"])
    return flops / (run["gpus"] * run["tflops"] * 1e12)


def memory_of(plan) -> tuple[float, float]:
    """(model state, activations) in bytes of the plan's rank with the most at its peak."""
    p = plan.largest()
    return p.state, p.memory["activations"]


def table(log=print, plan_of=None) -> list[dict]:
    """Each run planned: predicted and published step and their error; the peak memory per
    GPU and whether it fits, beside whether the run did; the model state and activations
    per GPU beside the paper's, where it gives them; the mean and the largest absolute error
    of the steps. ``plan_of``: the plan of a run's key (default: :func:`planned` of the run)."""
    log("run | GPUs | layout | published step s | predicted step s | error | peak per GPU | fits (as it did) | "
        "state and activations GiB, predicted (published)")
    rows = []
    for key, run in runs().items():
        plan = plan_of(key) if plan_of else planned(run)
        lay, peak = plan.layout, plan.largest().peak
        step, predicted = published_step(run), plan.time["step"]
        error = predicted / step - 1 if step else None
        row = {"run": key, "published": step, "predicted": predicted, "error": error, "peak": peak,
               "fits": peak <= plan.machine.memory, "ran": run.get("fits", True), "memory": memory_of(plan),
               "published memory": tuple(g * 2**30 for g in run.get("memory_gib", ()))}
        rows.append(row)
        memory = " / ".join(f"{x / 2**30:.1f}" + (f" ({y / 2**30:.1f})" if row["published memory"] else "")
                            for x, y in zip(row["memory"], row["published memory"] or (0, 0)))
        steps = (f"{step:.2f} | {predicted:.2f} | {100 * error:+.1f}%" if step
                 else f"(did not run) | {predicted:.2f} | -")
        recompute = run["recompute"].replace("none", "no")
        log(f"{key} | {run['gpus']} | tp {lay.tp} x pp {lay.pp} x dp {lay.dp}, {recompute} recomputation | "
            f"{steps} | {peak / 1e9:.1f} GB | {'yes' if row['fits'] else 'no'} ({'yes' if row['ran'] else 'no'}) | "
            f"{memory}")
    errors = [abs(r["error"]) for r in rows if r["error"] is not None]
    log(f"mean absolute error {100 * sum(errors) / len(errors):.1f}%, largest {100 * max(errors):.1f}%, "
        f"over {len(errors)} runs; fits as the papers ran them: {sum(r['fits'] == r['ran'] for r in rows)} of "
        f"{len(rows)}")
    return rows


def run(log=print) -> list[dict]:
    """``mpitrain bench published``: the catalogue read first (a user's file that cannot be
    used is said before any row)."""
    from mpitrain.plan import hardware

    hardware.load()
    return table(log)
