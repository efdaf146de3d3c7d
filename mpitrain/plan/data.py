"""The data a config trains on, as the planner needs it: its kind, one sample's shape,
the vocabulary or classes, and the bytes storage delivers per sample.

Read from the dataset's manifest when the dataset is there (no shard is opened); else from
what mpitrain's recipes are known to build (:data:`KNOWN`), said so in the plan.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from mpitrain.config import ConfigError


@dataclass(frozen=True)
class DataShape:
    name: str
    kind: str  # "text" or "image"
    sample: tuple  # an image's (H, W, C); () for text (the model's context sets the window)
    ids: int  # the vocabulary (text) or the classes (images)
    x_itemsize: int  # bytes of a pixel or token as stored
    y_itemsize: int  # bytes of a label as stored (0: text)
    train: int  # training samples (images) or tokens (text)
    source: str  # where these figures come from: the manifest's path, or "assumed"

    def reader(self, T: int, B: int, b: int, buffer_mb: float, prefetch: int) -> int:
        """Bytes the shard reader of a rank with ``b`` of the ``B`` samples of a step holds
        (:func:`mpitrain.cost.reader_bytes`): rounds of ``K`` steps, as many as
        ``buffer_mb`` of the global batches hold (at most an epoch); a text window of
        ``T + 1`` tokens with a 1-byte placeholder label, an image with its label."""
        from mpitrain.cost import reader_bytes

        if self.kind == "text":
            n, item, label = max(1, (self.train - T) // T), (T + 1) * self.x_itemsize, 1
        else:
            n, item, label = self.train, self.bytes_per_sample() - self.y_itemsize, self.y_itemsize
        steps = n // B
        K = max(1, min(int(buffer_mb * 2**20) // max(1, B * item), steps)) if steps else 1
        return reader_bytes(b, K, item + label, prefetch)

    def bytes_per_sample(self, window: int = 0, random: bool = False) -> int:
        """What storage delivers per training sample (the reader's ``sample_bytes``): an
        image and its label; a text window of ``window`` tokens ``window`` new tokens
        read in order ("stride"), all ``window + 1`` drawn at random."""
        if self.kind == "text":
            return (window + random) * self.x_itemsize
        pixels = 1
        for n in self.sample:
            pixels *= n
        return pixels * self.x_itemsize + self.y_itemsize


# what the recipes build, for a dataset not built yet (name, or a data.path's last folder)
KNOWN = {
    "mnist5k": DataShape("mnist5k", "image", (28, 28, 1), 10, 1, 1, 4000, "assumed"),
    "mnist": DataShape("mnist", "image", (28, 28, 1), 10, 1, 1, 60000, "assumed"),
    "fashion-mnist": DataShape("fashion-mnist", "image", (28, 28, 1), 10, 1, 1, 60000, "assumed"),
    "cifar10": DataShape("cifar10", "image", (32, 32, 3), 10, 1, 1, 50000, "assumed"),
    "shakespeare": DataShape("shakespeare", "text", (), 84, 1, 0, 4551478, "assumed"),
    "tinyshakespeare": DataShape("tinyshakespeare", "text", (), 65, 1, 0, 1003854, "assumed"),
}


def resolve(cfg) -> DataShape:
    """The data of ``cfg.data``: its manifest if built, else :data:`KNOWN` by name."""
    from mpitrain.data.manifest import read_manifest

    d = cfg.data
    if d.path:
        where = Path(d.path)
    else:
        from mpitrain_datasets import embedded

        where = embedded.location(d.name)
    if (where / "manifest.json").is_file():
        m = read_manifest(where)
        split = m["splits"]["train"]
        x = _itemsize(split["x_dtype"])
        y = _itemsize(split["y_dtype"]) if split.get("y_dtype") else 0
        ids = len(m["vocab"]) if m["kind"] == "text" else len(m["classes"])
        return DataShape(m["name"], m["kind"], tuple(split["sample_shape"]), ids, x, y, split["count"], str(where))
    for key in (d.name if not d.path else "", where.name, where.name.replace("_", "-")):
        if key in KNOWN:
            return KNOWN[key]
    raise ConfigError(f"data.path: {where} holds no dataset (no manifest.json) and is not one the planner knows "
                      f"({', '.join(sorted(KNOWN))}); build it first (mpitrain data build ...)")


def _itemsize(dtype: str) -> int:
    import numpy as np

    return np.dtype(dtype).itemsize
