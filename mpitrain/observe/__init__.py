"""Watching a run: FLOP counting, the per-rank I/O and time tables, metrics.jsonl, the
Chrome-trace timeline, the stall watchdog, and ``mpitrain report``'s plots."""
