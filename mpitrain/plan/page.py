"""``mpitrain plan ... --html FILE``: the plan as one HTML page a browser opens, with nothing
to fetch (no network, no JavaScript; the figures drawn by matplotlib, inline as SVG):

* the verdict, then per rank (alike grouped) the memory stacked by category against the
  device's memory;
* the step time's parts (compute, exposed communication, bubble, I/O wait);
* the bytes each rank sends per step on each communicator (``dp``, ``pp``, ``tp``);
* with pipeline stages, the schedule as a timeline (:func:`mpitrain.schedules.simulate`,
  in units of one stage's forward pass);
* with ``--search``, each layout's predicted step time against its peak memory, the
  fastest marked; with ``--validate``, each counted quantity predicted against measured;
* the plan's text, as ``mpitrain plan`` prints it.
"""

from __future__ import annotations

import html
import io
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: no display needed
import matplotlib.pyplot as plt

from mpitrain import cost
from mpitrain.output import write_text
from mpitrain.plan.show import categories, ranks_text, size, verdict

STYLE = ("body{font-family:sans-serif;max-width:1100px;margin:2em auto;color:#222}"
         "h1{font-size:1.4em}h2{font-size:1.1em;margin-top:2em}.verdict{font-size:1.1em;font-weight:bold}"
         "pre{background:#f6f6f6;padding:1em;overflow-x:auto;font-size:.8em}svg{max-width:100%;height:auto}")


def svg(fig) -> str:
    """``fig`` as an inline SVG element (closed after)."""
    out = io.StringIO()
    fig.tight_layout()
    fig.savefig(out, format="svg")
    plt.close(fig)
    text = out.getvalue()
    return text[text.index("<svg"):]


def shown(plan) -> list:
    """The rank groups a figure shows: every group, or where there are many (a large job's
    ranks differ in small ways), the largest of each part of the model."""
    if len(plan.ranks) <= 16:
        return plan.ranks
    largest: dict = {}
    for p in plan.ranks:
        if p.where not in largest or p.peak > largest[p.where].peak:
            largest[p.where] = p
    return list(largest.values())


def memory_figure(plan):
    """Per rank group (:func:`shown`), its memory stacked by category; the device's memory
    as a line when the peak is within sight of it."""
    groups = shown(plan)
    fig, ax = plt.subplots(figsize=(min(12, max(6, 1.1 * len(groups) + 3)), 4))
    labels = _labels(ax, groups)
    bottom = [0.0] * len(groups)
    scale, unit = _unit(max(p.peak for p in groups))
    for category in categories(plan):
        heights = [p.memory[category] / scale for p in groups]
        if any(heights):
            ax.bar(labels, heights, bottom=bottom, label=category)
            bottom = [b + h for b, h in zip(bottom, heights)]
    limit = plan.machine.memory
    if limit < 20 * max(p.peak for p in groups):
        ax.axhline(limit / scale, color="black", linestyle="--", label=f"memory per rank, {size(limit)}")
    else:
        ax.set_title(f"(memory per rank: {size(limit)}, off this scale)", fontsize=9)
    ax.set_ylabel(unit)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1, 1))
    return fig


def time_figure(plan):
    t = plan.time
    parts = [("compute", t["compute"]), ("exposed communication", t["exposed"]), ("bubble", t["bubble"]),
             ("I/O wait", t["io_wait"])]
    scale, unit = (1.0, "s") if t["step"] >= 10 else (1e3, "ms")
    fig, ax = plt.subplots(figsize=(9, 1.8))
    left = 0.0
    for name, seconds in parts:
        ax.barh([0], [scale * seconds], left=left, label=f"{name} {scale * seconds:.3g} {unit}")
        left += scale * seconds
    ax.set_yticks([])
    ax.set_xlabel(f"{unit} of a step ({scale * t['step']:.3g} {unit})")
    ax.legend(fontsize=8, ncol=4, loc="lower center", bbox_to_anchor=(0.5, 1))
    return fig


def traffic_figure(plan):
    groups = shown(plan)
    axes = [a for a in ("dp", "pp", "tp") if any(p.sent.get(a) for p in groups)]
    if not axes:
        return None
    fig, ax = plt.subplots(figsize=(min(12, max(6, 1.1 * len(groups) + 3)), 3.5))
    width = 0.8 / len(axes)
    scale, unit = _unit(max(p.sent.get(a, 0) for p in groups for a in axes))
    for k, a in enumerate(axes):
        ax.bar([i + k * width for i in range(len(groups))], [p.sent.get(a, 0) / scale for p in groups], width,
               label=a)
    ax.set_xticks([i + width * (len(axes) - 1) / 2 for i in range(len(groups))], _labels(ax, groups))
    ax.set_ylabel(f"{unit} sent per step")
    ax.legend(fontsize=8)
    return fig


def pipeline_figure(plan):
    """The schedule of the plan's stages as a timeline, in units of one stage's forward
    pass (backward twice that; a zero-bubble schedule's input and weight passes one each)."""
    from mpitrain import schedules

    lay = plan.layout
    if lay.pp == 1:
        return None
    p, m, v, name = lay.pp, lay.m, lay.v, lay.par.schedule
    sim = schedules.simulate([schedules.schedule(name, p, m, r, v) for r in range(p)], p, v)
    colors = {"F": "tab:blue", "B": "tab:orange", "I": "tab:orange", "W": "tab:green"}
    fig, ax = plt.subplots(figsize=(10, 0.5 * p + 1.2))
    for r, spans in enumerate(sim.spans):
        for code, color in colors.items():  # one call a rank and kind: a large schedule has thousands of spans
            ax.broken_barh([(start, end - start) for start, end, a in spans if a.code == code], (r - 0.4, 0.8),
                           facecolors=color, edgecolors="white")
        if m * v <= 16:
            for start, end, action in spans:
                ax.text((start + end) / 2, r, str(action), ha="center", va="center", fontsize=7, color="white")
    ax.set_yticks(range(p), [f"stage {r}" for r in range(p)])
    ax.invert_yaxis()
    ax.set_xlabel("time, in one stage's forward passes")
    idle = cost.pipeline_idle(name, p, m, v)  # in the figure's units; its share of the step: the plan's text
    ax.set_title(f"{name}: {p} stages x {m} micro-batches{f' x {v} chunks' if v > 1 else ''}: {idle:g} idle "
                 "units of F + B + W per stage", fontsize=10)
    return fig


def search_figure(fits: list, over: list, limit: float, best: list):
    """Each layout planned (anything with a ``peak`` and a ``step``): its step time against
    its peak memory; ``best``, the fastest that fit, marked. Thousands of points are drawn
    as one image inside the SVG."""
    fig, ax = plt.subplots(figsize=(8, 4.5))
    everything = fits + over
    scale, unit = _unit(max(f.peak for f in everything))
    many = len(everything) > 2000
    ax.scatter([f.peak / scale for f in over], [1e3 * f.step for f in over], s=8, color="lightgray",
               label="does not fit", rasterized=many)
    ax.scatter([f.peak / scale for f in fits], [1e3 * f.step for f in fits], s=8, color="tab:blue", label="fits",
               rasterized=many)
    ax.scatter([f.peak / scale for f in best], [1e3 * f.step for f in best], s=40, facecolors="none",
               edgecolors="tab:red", label=f"the {len(best)} fastest")
    if limit < 20 * max(f.peak for f in everything):
        ax.axvline(limit / scale, color="black", linestyle="--", label=f"memory per rank, {size(limit)}")
    else:
        ax.set_title(f"(memory per rank: {size(limit)}, off this scale)", fontsize=9)
    ax.set_xlabel(f"peak memory per rank ({unit})")
    ax.set_ylabel("step time (ms)")
    ax.set_yscale("log")
    ax.legend(fontsize=8)
    return fig


def validate_figure(rows: list):
    """Each counted quantity (and the heap) predicted against measured, on a diagonal."""
    pairs = [(p, m) for _, _, p, m in rows if p > 0 and m > 0]
    fig, ax = plt.subplots(figsize=(5, 5))
    ax.scatter([p for p, _ in pairs], [m for _, m in pairs], s=12)
    lo, hi = min(min(pair) for pair in pairs), max(max(pair) for pair in pairs)
    ax.plot([lo, hi], [lo, hi], color="gray", linewidth=1)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("predicted")
    ax.set_ylabel("measured")
    ax.set_title(f"{len(pairs)} quantities", fontsize=10)
    return fig


def write(path, plan, text: str, title: str, sections=()) -> Path:
    """The page: ``title``, the plan's verdict and figures, ``sections`` ((heading,
    figure) pairs, e.g. a search's or a validation's), then ``text``."""
    figures = [("Memory per rank", memory_figure(plan)), ("The step's time", time_figure(plan)),
               ("Bytes sent per step", traffic_figure(plan)), ("The pipeline's schedule", pipeline_figure(plan)),
               *sections]
    body = [f"<h1>{html.escape(title)}</h1>", f'<p class="verdict">{html.escape(verdict(plan))}</p>']
    for heading, fig in figures:
        if fig is not None:
            body += [f"<h2>{html.escape(heading)}</h2>", svg(fig)]
    body += ["<h2>The plan</h2>", f"<pre>{html.escape(text)}</pre>"]
    page = (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>'
            f"<style>{STYLE}</style></head><body>\n" + "\n".join(body) + "\n</body></html>\n")
    return write_text(path, page)  # whole or not at all


def _labels(ax, groups: list) -> list[str]:
    """A rank group's name under its bar: its ranks and part (a few groups whose ranks' names
    are short), or the parts alone, turned."""
    if len(groups) <= 6 and all(len(ranks_text(p.ranks)) <= 12 for p in groups):
        return [f"{ranks_text(p.ranks)}\n{p.where}" for p in groups]
    ax.tick_params(axis="x", labelrotation=60, labelsize=7)
    return [p.where for p in groups]


def _unit(largest: float) -> tuple[float, str]:
    for scale, unit in ((1e12, "TB"), (1e9, "GB"), (1e6, "MB"), (1e3, "kB")):
        if largest >= scale:
            return scale, unit
    return 1.0, "B"
