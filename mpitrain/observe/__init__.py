"""Measuring a run: FLOP counting (timers, timelines and reports join later)."""
