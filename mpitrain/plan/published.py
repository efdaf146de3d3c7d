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
         "position_embedding", "bias")


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
                 "parallel.sequence_parallel": run.get("sequence_parallel", False)})
    dp = run["gpus"] // (run["tp"] * run["pp"])
    sets["train.micro_batches"] = run["global_batch_size"] // (dp * run["micro_batch"])
    if run["pp"] > 1:
        sets.update({"parallel.schedule": run["schedule"], "parallel.chunks": run["chunks"]})
    nodes = math.ceil(run["gpus"] / run["per_node"])
    text = lambda v: str(v).lower() if isinstance(v, bool) else str(v)  # noqa: E731 (TOML's true/false)
    return argparse.Namespace(config=None, model="gpt2", set=[f"{k}={text(v)}" for k, v in sets.items()],
                              hardware=run["hardware"], ranks=run["gpus"], nodes=nodes, per_node=run["per_node"],
                              network=run["network"] if nodes > 1 else None, intra=None, utilization=0.4,
                              memory_per_rank=None, catalogue=None, mfu=None)


def planned(run: dict):
    """The plan of ``run``."""
    from mpitrain import plan as planner

    return planner.from_args(args_of(run))[0]


def table(log=print) -> list[dict]:
    """Each run planned: predicted and published step, their error, the peak memory per GPU
    and whether it fits; the mean and the largest absolute error."""
    log("run | GPUs | layout | published step s | predicted step s | error | peak per GPU | fits")
    rows = []
    for key, run in runs().items():
        plan = planned(run)
        lay, peak = plan.layout, plan.largest().peak
        error = plan.time["step"] / run["step_s"] - 1
        rows.append({"run": key, "published": run["step_s"], "predicted": plan.time["step"], "error": error,
                     "peak": peak, "fits": peak <= plan.machine.memory})
        log(f"{key} | {run['gpus']} | tp {lay.tp} x pp {lay.pp} x dp {lay.dp}, {run['recompute']} recomputation | "
            f"{run['step_s']:.2f} | {plan.time['step']:.2f} | {100 * error:+.1f}% | {peak / 1e9:.1f} GB | "
            f"{'yes' if rows[-1]['fits'] else 'no'}")
    errors = [abs(r["error"]) for r in rows]
    log(f"mean absolute error {100 * sum(errors) / len(errors):.1f}%, largest {100 * max(errors):.1f}%, "
        f"over {len(rows)} runs")
    return rows


def run(log=print) -> list[dict]:
    """``mpitrain bench published``."""
    return table(log)
