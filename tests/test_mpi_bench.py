"""MPI tier: ``mpitrain bench allreduce``, ``bench ddp``, ``bench ps`` and ``bench
pipeline`` run end to end on small sizes and report every variant (their figures are
measurements, so only their form is tested)."""

import math

import pytest

from mpitrain.comm import world

pytestmark = pytest.mark.same_under_any_mpi  # mpitrain's logic above MPI: MPICH's tier checks it for both


@pytest.mark.mpi(min_size=2)
def test_bench_allreduce_reports_every_size_for_each_group():
    from mpitrain.bench import allreduce

    lines = []
    rows = allreduce.run(repeats=1, sizes=[4 << 10, 64 << 10], log=lines.append)
    groups = [p for p in (2, 4) if p <= world().size]
    mine = [p for p in groups if world().rank < p]
    assert [(r["ranks"], r["bytes"]) for r in rows] == [(p, n) for p in mine for n in (4 << 10, 64 << 10)]
    for r in rows:
        assert all(math.isfinite(r[k]) and r[k] > 0 for k in ("mpi", "ring", "bound"))
    if world().rank == 0:
        assert any("ring/mpi" in line for line in lines) and any("64 KiB" in line for line in lines)


@pytest.mark.mpi(min_size=2)
def test_bench_ddp_times_every_variant(monkeypatch):
    from mpitrain.bench import ddp

    if world().size != 2:
        pytest.skip("bench ddp runs on exactly 2 ranks")
    monkeypatch.setitem(ddp.MODELS, "tiny", {"n_layer": 1, "n_head": 2, "n_embd": 16, "block_size": 8, "batch": 4})
    lines = []
    med = ddp.run(models=("tiny",), rounds=1, steps=2, bucket_mb=1e-3, log=lines.append)["tiny"]
    variants = {"1 rank", "2 ranks, no comm", "2 ranks, ddp (off)", "2 ranks, ddp (test)", "2 ranks, ddp (none)",
                "allreduce alone (blocking)", "allreduce alone (started)"}
    assert variants <= set(med) and all(med[k] > 0 for k in variants)
    if world().rank == 0:
        assert any("exposed" in line and "vs off" in line for line in lines)
        assert any(line.startswith("  total communication") for line in lines)
        assert any(line.startswith("  probe:") for line in lines)
    assert {"compute", "allreduce", "test", "none"} <= set(med["probe"])


@pytest.mark.mpi(min_size=4)
def test_bench_ps_times_every_mode():
    from mpitrain.bench import ps

    if world().size != 4:
        pytest.skip("bench ps runs on exactly 4 ranks")
    lines = []
    med = ps.run(steps=3, rounds=1, batch=2, log=lines.append)
    assert set(med) == set(ps.MODES) and all(v > 0 for v in med.values())
    if world().rank == 0:
        assert sum("vs sync | steps per worker" in line for line in lines) == len(ps.MODES)


@pytest.mark.mpi(min_size=2)
def test_bench_pipeline_measures_every_schedule(monkeypatch):
    from mpitrain.bench import pipeline
    from mpitrain.cost import bubble_fraction

    p = world().size
    if p > 2:
        pytest.skip("the bench's form, on 2 ranks (test_mpi_pipeline.py runs every schedule on 4 stages)")
    monkeypatch.setattr(pipeline, "C", 16)
    monkeypatch.setattr(pipeline, "T", 8)
    lines = []
    rows = pipeline.run(rounds=1, ms=(p, 2 * p), batch=4 * p, log=lines.append)
    assert [(r["schedule"], r["m"]) for r in rows] == [
        (s, m) for m in (p, 2 * p) for s in ("gpipe", "1f1b", "interleaved v=2", "zb-h1")]
    for r in rows:
        assert r["step_ms"] > 0 and 0 <= r["bubble"] < 1 and len(r["held_mb"]) == p and min(r["held_mb"]) > 0
        if r["schedule"] in ("gpipe", "1f1b"):
            assert r["formula"] == bubble_fraction(r["schedule"], p, r["m"])
    if world().rank == 0:
        assert any("meas/formula" in line for line in lines)
        assert any(f"m={2 * p}: stage 0 holds" in line for line in lines)


@pytest.mark.mpi(min_size=2)
def test_bench_tensor_measures_both_variants():
    from mpitrain.bench import tensor

    if 4 % world().size:
        pytest.skip("4 heads over the ranks")
    lines = []
    f = tensor.run(rounds=1, steps=1, batch=2, n_blocks=1, n_embd=16, n_head=4, seq=8, log=lines.append)
    assert f["one_ms"] > 0 and f["tp_ms"] > 0 and f["allreduce_ms_per_block"] > 0
    assert f["bytes_per_block"] == pytest.approx(f["formula_bytes_per_block"])
    assert len(f["held_mb"]) == world().size and f["held_whole_mb"] > 0
    assert f["sp_ms"] > 0 and len(f["held_sp_mb"]) == world().size
    if world().rank == 0:
        assert any("speed-up" in line for line in lines)
