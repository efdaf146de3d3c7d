"""Calibration's count of Python's own objects: what a training process holds at rest
beyond the arrays the planner counts (modules and parameters as objects, every array's
header, the optimizer's and the checkpoint layout's entries, the run's records), which
``tracemalloc`` sees and ``mpitrain plan --validate`` holds the heap at rest against.

It is measured, not derived, because it is the interpreter's and NumPy's: the trainer runs
on one process for a few steps on synthetic data (GPTs of 1 and 6 blocks, ResNets of 1
and 3 blocks a stage), and the heap at rest less what the planner predicts without it is
fitted to a line in the parameter arrays trained (:func:`measure_objects`; the planner
adds it per rank, :func:`mpitrain.plan.predict.rank_plans`).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from mpitrain.plan.hardware import HardwareError
from mpitrain.plan.probes import probed

MODELS = (  # each with the optimizer its kind's shipped jobs use
    ({"name": "gpt", "n_layer": 1, "n_head": 2, "n_embd": 32, "block_size": 16}, {"name": "adamw"}),
    ({"name": "gpt", "n_layer": 6, "n_head": 2, "n_embd": 32, "block_size": 16}, {"name": "adamw"}),
    ({"name": "resnet", "widths": [4, 8, 16], "blocks": 1}, {"name": "sgd", "lr": 0.1, "momentum": 0.9}),
    ({"name": "resnet", "widths": [4, 8, 16], "blocks": 3}, {"name": "sgd", "lr": 0.1, "momentum": 0.9}))


def _datasets(root: Path) -> dict:
    """Small synthetic datasets in ``root/text`` and ``root/image`` (random tokens, random
    16x16 RGB images)."""
    from mpitrain.data import DatasetWriter

    gen = np.random.default_rng(0)
    with DatasetWriter(root / "text", "calibration-text", "text", vocab="abcdefghijklmnop") as w:
        w.write_split("train", gen.integers(0, 16, 4096, dtype=np.uint8))
        w.write_split("val", gen.integers(0, 16, 512, dtype=np.uint8))
    with DatasetWriter(root / "image", "calibration-images", "image", classes=list("0123456789"),
                       mean=[0.5] * 3, std=[0.25] * 3) as w:
        w.write_split("train", gen.integers(0, 256, (256, 16, 16, 3), dtype=np.uint8),
                      gen.integers(0, 10, 256, dtype=np.uint8))
        w.write_split("test", gen.integers(0, 256, (32, 16, 16, 3), dtype=np.uint8),
                      gen.integers(0, 10, 32, dtype=np.uint8))


def measure_objects(log=print) -> tuple[float, float]:
    """(kB, kB per parameter array) of the Python objects a training process holds at rest
    beyond the arrays the planner counts: the line through :func:`beyond_arrays` of each of
    :data:`MODELS`, each in a process of its own (as a run starts: what its first steps
    import and cache counts), against their parameter arrays. The processes run side by
    side: they count bytes, not time."""
    arrays, extra = [], []
    with tempfile.TemporaryDirectory(prefix="mpitrain-objects-") as tmp:
        _datasets(Path(tmp))
        procs = [subprocess.Popen([sys.executable, "-m", "mpitrain.plan.objects", str(i), tmp], text=True,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE) for i in range(len(MODELS))]
        try:
            outputs = [p.communicate(timeout=300) for p in procs]
            done = [subprocess.CompletedProcess(p.args, p.returncode, *out) for p, out in zip(procs, outputs)]
        finally:
            for p in procs:  # a timeout, or Ctrl-C: none left running
                if p.poll() is None:
                    p.kill()
                    p.wait()
        for (model, _), finished in zip(MODELS, done):
            found = probed(finished, f"the count of Python's objects ({model['name']})")
            arrays.append(found["arrays"])
            extra.append(found["extra"])
            log(f"objects: {model['name']} of {arrays[-1]} parameter arrays: {extra[-1]:,} B at rest beyond its "
                "arrays")
    per_array, base = np.polyfit(arrays, extra, 1)
    if not (per_array > 0 and base > 0):
        raise HardwareError(f"Python's objects at rest fitted to {base:.0f} B + {per_array:.0f} B per parameter "
                            "array: not a positive line; calibrate again")
    return float(f"{base / 1e3:.4g}"), float(f"{per_array / 1e3:.4g}")


def beyond_arrays(i: int, root: Path) -> dict:
    """{"arrays": parameter arrays, "extra": bytes}: :data:`MODELS`'s ``i``-th trained for 4
    steps on one process (data from :func:`_datasets` in ``root``), its heap at rest less its
    reader's, less the planner's prediction without Python's objects."""
    from mpitrain import config
    from mpitrain.comm import SingleComm
    from mpitrain.plan.data import resolve
    from mpitrain.plan.layout import Layout
    from mpitrain.plan.predict import rank_plans
    from mpitrain.plan.validate import measure

    model, optimizer = MODELS[i]
    kind = "text" if model["name"] == "gpt" else "image"
    cfg = config.from_dict({"model": model, "data": {"path": str(root / kind)}, "optim": optimizer,
                            "train": {"global_batch_size": 8, "steps": 4, "threads": 1}})
    lay = Layout.of(cfg, 1, resolve(cfg))
    heap = measure(cfg, SingleComm(), 4, trace=True)[0].states[0][1]
    extra = heap["rest"] - heap["parts"].get("data", 0) - rank_plans(lay)[0].rest
    return {"arrays": len(lay.parameters(0)), "extra": extra}


if __name__ == "__main__":  # one model's count, in a process of its own (measure_objects)
    print(json.dumps(beyond_arrays(int(sys.argv[1]), Path(sys.argv[2]))), flush=True)
