"""``mpitrain report`` and the job scripts in jobs/."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_comm import needs_mpiexec
from test_train import JOBS, mpitrain

from mpitrain import config, train
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
    assert "1 rank(s), ddp, global batch 8" in text and "step 12/12" in text and "val loss" in text
    assert "rank 0: compute" in text and "last checkpoint:" in text
    assert lines[0].startswith(f"run {tmp_path / 'a'}")


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


def test_every_job_script_parses():
    scripts = sorted(JOBS.glob("*.sh")) + sorted(JOBS.glob("*.sbatch"))
    assert {p.name for p in scripts} >= {"local.sh", "scaling_local.sh", "slurm_ddp.sbatch", "slurm_zero1.sbatch",
                                         "slurm_ps.sbatch", "scaling_slurm.sbatch"}
    for p in scripts:
        out = subprocess.run(["bash", "-n", str(p)], capture_output=True, text=True, check=False)
        assert out.returncode == 0, f"{p.name}: {out.stderr}"
        assert os.access(p, os.X_OK), f"{p.name} is not executable"


@needs_mpiexec
def test_the_local_scaling_study_runs_on_1_and_2_ranks_and_plots(text_data, tmp_path):
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    out = subprocess.run(["bash", str(JOBS / "scaling_local.sh"), str(JOBS / "tinyshakespeare_gpt.toml"), "1", "2",
                          "--", "--set", f"data.path={text_data}", "--set", "model.n_layer=1", "--set",
                          "model.n_embd=16", "--set", "model.n_head=2", "--set", "model.block_size=8",
                          "--set", "train.steps=20", "--set", "train.log_interval=10", "--set", "train.eval_batches=2"],
                         capture_output=True, text=True, cwd=tmp_path, env=env, timeout=240, check=False)
    assert out.returncode == 0, out.stderr
    plot = tmp_path / "runs" / "scaling" / "tinyshakespeare_gpt" / "scaling.png"
    assert plot.read_bytes()[:8] == PNG
    assert "scaling: 2 rank(s):" in out.stdout and "efficiency" in out.stdout
    out = subprocess.run(["bash", str(JOBS / "local.sh"), "nonsense", str(JOBS / "tinyshakespeare_gpt.toml")],
                         capture_output=True, text=True, cwd=tmp_path, env=env, timeout=60, check=False)
    assert out.returncode == 2 and "unknown strategy 'nonsense'" in out.stderr


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
