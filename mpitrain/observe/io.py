"""The per-rank I/O table: what each rank read, how fast, and how long training waited.

The storage bandwidth a rank *needs* is bytes per sample x samples per second
(Ibrahim et al., PMBS 2021); *headroom* is the read speed it measured divided by that
need. DLIO counts a run as I/O-bound when the compute is busy less than 90% of the
time, so a stall share above 10% means storage (or the reader) is the bottleneck.
"""

from __future__ import annotations

from mpitrain.cost import storage_bandwidth


def io_row(rank: int, stats, busy_seconds: float) -> dict:
    """One rank's figures for one epoch; ``busy_seconds`` is the time of its training
    steps (or of whatever consumed the batches), without the stall."""
    total = busy_seconds + stats.stall_seconds
    return {"rank": rank, "mb": stats.bytes_read / 1e6, "read_s": stats.read_seconds,
            "mb_s": stats.read_mb_per_s, "samples": stats.samples,
            "samples_s": stats.samples / total if total else 0.0,
            "stall_s": stats.stall_seconds, "stall_pct": 100 * stats.stall_seconds / total if total else 0.0}


def io_table(title: str, rows: list[dict], sample_bytes: int) -> str:
    """The table rank 0 prints, one row per rank, then the need and the headroom."""
    lines = [f"{title}: rank | read MB | read s |     MB/s | samples/s | stall s | stall %"]
    for r in rows:
        lines.append(f"{'':>{len(title)}}  {r['rank']:>4} | {r['mb']:7.1f} | {r['read_s']:6.3f} | "
                     f"{r['mb_s']:8.0f} | {r['samples_s']:9.0f} | {r['stall_s']:7.3f} | {r['stall_pct']:6.2f}%")
    slowest = min(rows, key=lambda r: r["mb_s"])
    rate = max(r["samples_s"] for r in rows)
    need = storage_bandwidth(sample_bytes, rate) / 1e6
    headroom = slowest["mb_s"] / need if need else float("inf")
    lines.append(f"{'':>{len(title)}}  needs {need:.2f} MB/s per rank ({sample_bytes} B/sample x {rate:,.0f} "
                 f"samples/s); slowest read {slowest['mb_s']:,.0f} MB/s: headroom {headroom:,.0f}x")
    return "\n".join(lines)
