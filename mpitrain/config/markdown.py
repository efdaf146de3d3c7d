"""The configuration reference, ``jobs/CONFIG.md`` (``mpitrain config reference``), generated
from the fields in :mod:`mpitrain.config.fields` and the ``#:`` comment at each."""

from __future__ import annotations

import ast
import io
import json
import tokenize
import typing
from pathlib import Path

from mpitrain.config import fields as _fields
from mpitrain.config.fields import (CHOICES, IMAGE_ONLY_TRAIN_FIELDS, PARALLEL_FIELDS, RENAMED, TEXT_ONLY_TRAIN_FIELDS,
                                    WHOLE_REPLICA_SYNCS, Config, sections)

_TYPE_NAMES = {str: "string", int: "integer", float: "number", bool: "boolean", tuple[int, ...]: "list of integers",
               tuple[str, ...]: "list of strings",
               tuple[float, float]: "list of 2 numbers"}
_INTRO = ("Generated from `mpitrain/config/fields.py` by `mpitrain config reference --out jobs/CONFIG.md` (edit "
          "the code; a test compares the two). A field left out takes its default; `--set section.field=VALUE` sets "
          "one (TOML syntax). How to run a config: [README.md](README.md).")


def reference() -> str:
    """The configuration reference, ``jobs/CONFIG.md``, in Markdown: every field with its
    type, its default (as TOML), its meaning (the ``#:`` comment at it, on its line or on
    the lines above; ValueError if there is none), and, in the sections with a choice
    (``model.name``, ``optim.name``, ``parallel.sync``), the choices that read it."""
    source = Path(_fields.__file__).read_text(encoding="utf-8")
    comments = {t.start[0]: (t.string[2:].strip(), t.line.lstrip().startswith("#"))  # line: (text, on its own)
                for t in tokenize.generate_tokens(io.StringIO(source).readline) if t.string.startswith("#:")}
    fields = {(c.name, n.target.id): n for c in ast.parse(source).body if isinstance(c, ast.ClassDef)
              for n in c.body if isinstance(n, ast.AnnAssign)}
    out = ["# Configuration reference", "", _INTRO, ""]
    for section in sections():
        cls = typing.get_type_hints(Config)[section.name]
        choice, table = CHOICES.get(section.name, (None, {}))
        out += [f"## [{section.name}]", ""]
        if choice:
            out += [f"*applies to*: the values of `{section.name}.{choice}` that read the field; others refuse it.", ""]
        out += ["| field | type | default |" + " applies to |" * bool(choice) + " meaning |",
                "|---|---|---|" + "---|" * bool(choice) + "---|"]
        for name, annotation in typing.get_type_hints(cls).items():
            node, above = fields[cls.__name__, name], []
            while comments.get(node.lineno - 1 - len(above), ("", False))[1]:
                above.insert(0, comments[node.lineno - 1 - len(above)][0])
            meaning = " ".join(above) or comments.get(node.end_lineno, ("",))[0]
            if not meaning:
                raise ValueError(f"{section.name}.{name}: no '#:' comment at the field says what it means")
            readers = [value for value, read in table.items() if name in read]
            applies = f" {'all' if len(readers) == len(table) else ', '.join(readers)} |" if choice else ""
            out.append(f"| `{name}` | {_TYPE_NAMES[annotation]} | `{json.dumps(getattr(cls(), name))}` |{applies} "
                       f"{meaning.replace('|', chr(92) + '|')} |")
        out.append("")
    return "\n".join(out + _combinations() + [
        f"- `train.{'`, `train.'.join(sorted(TEXT_ONLY_TRAIN_FIELDS))}`: text models (`model.name = \"gpt\"`).",
        f"- `train.{'`, `train.'.join(sorted(IMAGE_ONLY_TRAIN_FIELDS))}`: image models.",
        "- `parallel.tp` > 1: `model.name = \"gpt\"` (tensor slicing cuts a transformer's layers).",
        *(f"- `{old}` is the old name of `{new}`: still read, with a note." for old, new in RENAMED.items()), "",
        "Every check, each with its message, is in `mpitrain/config/checks.py`: `validate`, and, once the ranks "
        "and the data are known, `check_ranks` and `check_against_data`.", ""])


def _combinations() -> list[str]:
    """The table of what combines with what: every gradient sync with pipeline stages,
    tensor slices (and sequence parallelism) and mixed precision, but the syncs that
    serve whole replicas."""
    out = ["## Combinations", "", "Every gradient sync combines with every other axis of the grid, but one:", "",
           "| `parallel.sync` | `parallel.pp` > 1 | `parallel.tp` > 1, `sequence_parallel` | `train.precision` "
           "`bf16` / `fp16` |", "|---|---|---|---|"]
    for sync in PARALLEL_FIELDS:
        whole = sync in WHOLE_REPLICA_SYNCS
        cell = "no: whole replicas only" if whole else "yes"
        note = " (`dp` = 1)" if sync == "local" else ""
        out.append(f"| `{sync}`{note} | {cell} | {cell} | {'no: float32' if whole else 'yes'} |")
    return out + ["", "Parameter servers serve whole replicas in float32: no such system shards the model "
                  "into stages or slices.", ""]
