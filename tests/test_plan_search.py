"""``mpitrain plan --search``: deterministic on a fixed calibration, every refusal counted by
its reason, and every proposal a layout the trainer's own checks accept. (``--measure``
runs layouts: its figures are measurements, in mpitrain/plan/README.md.)"""

import argparse
import json
import subprocess
import sys

import numpy as np
import pytest
from test_comm import needs_mpiexec

from mpitrain import cli
from mpitrain.config import check_ranks, load
from mpitrain.plan import hardware, machine_of, search, trial
from mpitrain.plan.models import config_of

CONFIG = "jobs/shakespeare_gpt.toml"


@pytest.fixture
def shipped(monkeypatch, tmp_path):
    """The shipped calibration alone, whatever this machine's home holds."""
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv(hardware.USER_ENV, raising=False)


def searched(*argv):
    args = cli.build_parser().parse_args(["plan", CONFIG, "--search", *argv])
    P, machine = machine_of(args)
    make = lambda sets: config_of(argparse.Namespace(**{**vars(args), "set": [*args.set, *sets]}))[0]  # noqa: E731
    return search.search(make, P, machine, memory=args.memory_per_rank), P, args


def test_grids_are_every_factorisation_data_parallel_first():
    assert search.grids(4) == [(4, 1, 1), (2, 1, 2), (2, 2, 1), (1, 1, 4), (1, 2, 2), (1, 4, 1)]
    assert search.grids(1) == [(1, 1, 1)] and len(search.grids(16)) == 15


def test_the_search_is_deterministic_counts_every_refusal_and_proposes_only_valid_layouts(shipped):
    (fits, over, refused), P, args = searched("-n", "4", "--memory-per-rank", "24MB")
    assert len(fits) + sum(refused.values()) == len(search.layouts(load(CONFIG), 4))
    assert refused["memory"] == len(over) > 0 and all(f.peak > 24e6 for f in over)
    assert any(f.plan.layout.pp > 1 and f.plan.layout.par.sequence_parallel for f in fits + over)  # they combine
    assert not refused.get("train.precision") and not refused.get("parallel.sync")  # every combination plans
    assert any(f.plan.layout.par.sync == "zero3" and f.plan.layout.tp * f.plan.layout.pp > 1 for f in fits + over)
    assert all(f.peak <= 24e6 for f in fits) and fits and [f.step for f in fits] == sorted(f.step for f in fits)
    for f in fits:  # what the trainer would do with the --set line: load it, check it on 4 ranks
        cfg = load(CONFIG, list(f.sets))
        assert check_ranks(cfg, 4) == (f.plan.layout.dp, f.plan.layout.pp, f.plan.layout.tp)
    (again, _, counted), _, _ = searched("-n", "4", "--memory-per-rank", "24MB")
    assert [(f.line, f.step) for f in again] == [(f.line, f.step) for f in fits] and counted == refused


def test_the_command_prints_the_fastest_with_the_line_that_runs_each(shipped):
    out = subprocess.run([sys.executable, "-m", "mpitrain", "plan", CONFIG, "-n", "2", "--search", "--top", "3"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith(f"search: {CONFIG} on 2 rank(s)") and " fit in " in lines[1]
    rows = [line for line in lines if line[:2] in ("1 ", "2 ", "3 ")]
    assert len(rows) == 3 and all("--set parallel.dp=" in r for r in rows)
    bad = subprocess.run([sys.executable, "-m", "mpitrain", "plan", CONFIG, "--search", "--cluster", "1x2@1gbit"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "NODESxRANKS@RATE with 2 nodes or more" in bad.stderr
    alone = subprocess.run([sys.executable, "-m", "mpitrain", "plan", CONFIG, "--measure", "3"],
                           capture_output=True, text=True, timeout=60)
    assert alone.returncode == 2 and alone.stderr.strip().splitlines() == [
        "mpitrain: error: --measure: goes with --search (mpitrain plan CONFIG -n P --search ...)"]


def test_a_gpu_search_takes_the_devices_mixed_precision_and_a_search_without_a_fit_exits_3(shipped, capsys):
    """A V100 (fp16 tensor cores, no bf16) is searched in float32 and fp16; a search where
    no layout fits says how many micro-batches it tried and what to do, exit 3 as a plan
    that does not fit."""
    assert cli.main(["plan", "--model", "gpt2", "--hardware", "v100", "-n", "8", "--search", "--top", "3"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line[:2] in ("1 ", "2 ", "3 ")]
    assert len(rows) == 3 and all("train.precision=bf16" not in r for r in rows)
    assert search.device_knobs(hardware.load().device("v100"))["precision"] == ("fp32", "fp16")
    assert cli.main(["plan", "--model", "llama3-70b", "--hardware", "h100", "-n", "8", "--search"]) == 3
    assert capsys.readouterr().out.splitlines()[-1].startswith(
        "no layout fits (the search splits a replica's batch into 1, 2, 4, 8 micro-batches): raise --memory-per-rank")


def test_spearman_ranks_with_ties_and_the_draw_of_others_is_seeded():
    assert trial.spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1)
    assert trial.spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1)
    assert trial.spearman([1, 2, 2, 3], [1, 2, 3, 4]) == pytest.approx(np.corrcoef([1, 2.5, 2.5, 4],
                                                                                    [1, 2, 3, 4])[0, 1])
    fits = [search.Found((f"parallel.dp={k}",), None) for k in range(30)]
    picks = trial.chosen(fits, 5)
    assert picks[:5] == fits[:5] and len(picks) == 10 and picks == trial.chosen(fits, 5)
    buckets = [search.Found(("parallel.sync=ddp", f"parallel.bucket_mb={mb}", "x"), None) for mb in (4, 1)]
    assert trial.distinct([*buckets, fits[0]]) == [buckets[0], fits[0]]  # the planner's preferred bucket, once
    at = [fits.index(p) for p in picks[5:]]
    assert all(k >= 5 for k in at) and at == sorted(at)


@needs_mpiexec
def test_measure_runs_the_chosen_layouts_and_writes_the_table_and_the_plot(tmp_path, shipped):
    """--measure end to end on a tiny GPT (its figures are measurements: only the form)."""
    cfg = tmp_path / "tiny.toml"
    cfg.write_text('[model]\nname = "gpt"\nn_layer = 1\nn_head = 2\nn_embd = 16\nblock_size = 16\n'
                   '[data]\nname = "shakespeare"\n[train]\nglobal_batch_size = 4\nsteps = 1\n')
    out = subprocess.run([sys.executable, "-m", "mpitrain", "plan", str(cfg), "-n", "2", "--search", "--measure", "1",
                          "--repeat", "2", "--steps", "5", "--out", str(tmp_path / "out")],
                         capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert "Spearman's rank correlation" in out.stdout and "over 2 layouts" in out.stdout
    saved = json.loads((tmp_path / "out" / "search.json").read_text())
    assert len(saved["layouts"]) == 2 and saved["layouts"][0]["predicted_rank"] == 1
    for layout in saved["layouts"]:  # each launched twice, its fastest run kept
        launches = [float(x) for x in layout["launches_s"].split()]
        assert len(launches) == 2 and layout["measured_s"] == pytest.approx(min(launches), rel=1e-5)
    assert (tmp_path / "out" / "search.png").stat().st_size > 0 and (tmp_path / "out" / "search.csv").exists()
