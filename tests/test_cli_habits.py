"""What a user of PyTorch, nanoGPT or torchrun types first, answered in one line with what
mpitrain calls it; and the command line's edges: an output the caller closed, values that
look like options, options that apply only with others, a plan that does not fit."""

import subprocess
import sys
from pathlib import Path

import pytest

from mpitrain import cli
from mpitrain.config import did_you_mean

JOBS = Path(__file__).parents[1] / "jobs"
CONFIG = str(JOBS / "shakespeare_gpt.toml")


@pytest.mark.parametrize("given, meant", [
    ("train.max_iters", "train.steps"), ("optim.learning_rate", "optim.lr"), ("model.n_layers", "model.n_layer"),
    ("train.batch_size", "train.global_batch_size"), ("train.warmup_steps", "optim.warmup_steps"),
    ("train.gradient_accumulation_steps", "train.micro_batches"), ("model.hidden_size", "model.n_embd"),
    ("model.num_attention_heads", "model.n_head"), ("optim.max_grad_norm", "optim.grad_clip"),
    ("train.lr", "optim.lr")])
def test_an_unknown_field_says_what_it_likely_meant(given, meant, capsys):
    assert did_you_mean(*given.split(".")) == meant
    assert cli.main(["train", CONFIG, "--set", f"{given}=1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"mpitrain: error: {given}: unknown field: did you mean {meant}? (the fields of [")
    assert err.count("\n") == 1


def test_a_field_nothing_is_close_to_lists_the_sections_fields(capsys):
    assert did_you_mean("train", "zzz") is None
    assert cli.main(["train", CONFIG, "--set", "train.zzz=1"]) == 2
    assert "train.zzz: unknown field (the fields of [train]: " in capsys.readouterr().err


@pytest.mark.parametrize("argv, hint", [
    (["train", CONFIG, "--gradient_accumulation_steps=4"], "a config field is set with --set: --set "
                                                           "train.micro_batches=4"),
    (["train", "-n", "2", CONFIG], "mpitrain runs on the ranks its launcher starts: mpiexec -n 2 mpitrain train"),
    (["train", CONFIG, "--nproc_per_node=4"], "mpiexec -n 4 mpitrain train CONFIG")])
def test_another_tools_options_are_answered_with_mpitrains(argv, hint, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2 and hint in capsys.readouterr().err


def test_plan_options_that_do_nothing_alone_are_refused_and_a_plan_that_does_not_fit_exits_3(capsys):
    assert cli.main(["plan", CONFIG, "--steps", "5"]) == 2
    assert "--steps: the steps of a run --validate or --measure makes" in capsys.readouterr().err
    assert cli.main(["plan", CONFIG, "--memory-per-rank", "1kB"]) == 3
    assert capsys.readouterr().out.splitlines()[-1].startswith("verdict: does not fit")
    with pytest.raises(SystemExit):  # a negative size: the option's own check, not "expected one argument"
        cli.main(["plan", CONFIG, "--memory-per-rank", "-5MB"])
    assert "--memory-per-rank: expected bytes such as 16GB" in capsys.readouterr().err


@pytest.mark.parametrize("argv, said", [
    (["plan", "--model", "gpt2", "-n", "2.5"], "argument -n/--ranks: must be a positive integer, got 2.5"),
    (["plan", "--model", "gpt2", "--hardware", "h100", "--mfu", "45%"],
     "argument --mfu: must be a share in (0, 1] such as 0.45, got 45%"),
    (["cluster", "--nodes", "two", "true"], "argument --nodes: must be a positive integer, got two"),
    (["plan", "--model", "gpt2", "--html", ""], "argument --html: expected a file's name, got none"),
    (["plan", "--model", "gpt2", "--memory-per-rank", "0"],
     "argument --memory-per-rank: expected bytes more than none, such as 16GB, got '0'")])
def test_an_options_value_is_refused_in_the_options_words_not_pythons(argv, said, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2 and capsys.readouterr().err.splitlines()[-1].endswith(f"error: {said}")


@pytest.mark.parametrize("argv", [["bench", "published"], ["plan", "--model", "gpt2", "--hardware", "a100-80g"],
                                  ["plan", CONFIG]])
def test_a_user_catalogue_that_is_not_there_is_one_line_before_any_output(argv, monkeypatch, tmp_path, capsys):
    missing = tmp_path / "hardware.toml"
    monkeypatch.setenv("MPITRAIN_HARDWARE", str(missing))
    assert cli.main(argv) == 2
    out, err = capsys.readouterr()
    assert (out, err) == ("", f"mpitrain: error: $MPITRAIN_HARDWARE: {missing}: no such hardware file\n")


@pytest.mark.parametrize("argv", [["plan", CONFIG], ["config", "reference"], ["--version"], ["plan", "--help"],
                                  ["train", "--help"], ["sample", "--help"], ["eval", "--help"], ["data", "--help"],
                                  ["bench", "--help"], ["report", "--help"], ["cluster", "--help"],
                                  ["launch", "--help"], ["train", "nothing.toml"]])
def test_no_command_tracebacks_with_its_output_closed(argv):
    """``mpitrain ... >&-``: what would be printed goes nowhere; the status is the command's."""
    out = subprocess.run([sys.executable, "-m", "mpitrain", *argv], stdout=subprocess.DEVNULL, stdin=subprocess.DEVNULL,
                         stderr=subprocess.PIPE, text=True, timeout=120, close_fds=True,
                         preexec_fn=lambda: __import__("os").close(1))
    assert "Traceback" not in out.stderr and out.returncode in (0, 2), out.stderr


def test_report_refuses_an_output_that_is_a_file_and_a_start_record_without_its_config(tmp_path, capsys):
    import json

    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text(json.dumps({"kind": "start", "step": 0}) + "\n")
    assert cli.main(["report", str(run)]) == 2
    err = capsys.readouterr().err
    assert "its 'start' record has no 'ranks' or 'config': not written by this mpitrain, or damaged" in err
    assert err.count("\n") == 1
    taken = tmp_path / "taken.png"
    taken.write_text("mine")
    (run / "metrics.jsonl").write_text(json.dumps({"kind": "start", "step": 0, "ranks": 1, "config": {}}) + "\n")
    assert cli.main(["report", str(run), "--out", str(taken)]) == 2
    assert f"--out {taken}: is a file; name a folder" in capsys.readouterr().err and taken.read_text() == "mine"


def test_config_show_prints_every_field_with_where_it_came_from_as_a_config_file(tmp_path, monkeypatch, capsys):
    """``mpitrain config show``: the config train would run, each value with its origin;
    the output is itself a config that loads to the same values."""
    import tomllib

    from mpitrain import config

    monkeypatch.chdir(tmp_path)
    assert cli.main(["config", "show", CONFIG, "--set", "train.steps=10", "--set", "parallel.strategy='ddp'"]) == 0
    out = capsys.readouterr().out
    cfg = config.load(CONFIG, ["train.steps=10"])
    values = [line.removeprefix("# ") for line in out.splitlines() if "  # " in line]
    assert len(values) == sum(len(t) for t in cfg.to_dict().values()) and all("  # " in v for v in values)
    lines = {line.split("=")[0].strip(): line.split("  # ", 1)[1] for line in values}
    shown = tomllib.loads(out)  # the defaults are comments: what is left is what was given
    assert {f"{s}.{k}" for s, t in shown.items() for k in t} == set(cfg.given) | {"parallel.sync"}
    assert shown["train"]["steps"] == 10 and '# dir = "runs/shakespeare_gpt"  # default: runs/<config name>' in out
    assert "# note: parallel.strategy is now spelled parallel.sync" in out
    assert lines["steps"] == "--set" and lines["sync"] == "--set"  # the old name set counts as the new
    assert lines["n_layer"] == CONFIG and lines["seed"] == "default"
    assert lines["channels"] == 'default; not read when model.name = "gpt"' and "# channels = [16, 32]" in out
    assert "# seed = 1337" in out and "\nsteps = 10" in out
    assert lines["dir"].startswith("default: runs/<config name>")
    (tmp_path / "shown.toml").write_text(out)
    again = config.load(tmp_path / "shown.toml", ["run.dir='runs/shakespeare_gpt'"])
    assert again.to_dict() == config.load(CONFIG, ["train.steps=10", "run.dir='runs/shakespeare_gpt'"]).to_dict()


def test_config_show_of_a_resumed_run_names_the_checkpoint_its_values_come_from(text_data, tmp_path, capsys):
    from test_checkpoint import gpt, quiet

    from mpitrain import checkpoint, train

    run = tmp_path / "a"
    train.train(gpt(text_data, run, "train.steps=4"), log=quiet)
    assert cli.main(["config", "show", "--resume", str(run), "--set", "optim.lr=1e-4"]) == 0
    lines = {line.removeprefix("# ").split(" = ")[0]: line.split("  # ", 1)[1]
             for line in capsys.readouterr().out.splitlines() if "  # " in line}
    saved = f"{checkpoint.path_for(run, 4)} (the resumed run's)"
    assert (lines["lr"], lines["n_embd"], lines["steps"], lines["dir"]) == ("--set", saved, saved, "--resume")
    assert lines["seed"] == "default"


def test_a_negative_sampling_seed_is_the_options_own_one_line(capsys):
    """Before: ``mpitrain sample RUN --seed -1`` reached NumPy: ``ValueError: expected non-negative integer``."""
    with pytest.raises(SystemExit) as e:
        cli.main(["sample", "runs/nothing", "--seed", "-1"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "argument --seed: must be a non-negative integer, got -1" in err
    assert "Traceback" not in err


def test_a_plan_under_mpiexec_is_printed_once():
    """Before: ``mpiexec -n 2 mpitrain plan CONFIG -n 2`` printed the whole plan twice."""
    import shutil

    mpiexec = shutil.which("mpiexec")
    if mpiexec is None:
        pytest.skip("needs mpiexec (pip install mpich)")
    done = subprocess.run([mpiexec, "-n", "2", sys.executable, "-m", "mpitrain", "plan", CONFIG, "-n", "2"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("\nverdict: fits") == 1 and done.stdout.count("step time:") == 1, done.stdout


def test_more_memory_per_rank_than_the_device_has_is_said(capsys):
    assert cli.main(["plan", "--model", "gpt2", "--hardware", "h100", "--memory-per-rank", "200GB"]) == 3
    assert "note: --memory-per-rank 200 GB is more than the device's 80 GB (NVIDIA H100 SXM5 80 GB)" in \
        capsys.readouterr().out.splitlines()


@pytest.mark.parametrize("extra, said", [
    (["--json", "x.json"], "--json: writes --validate's rows; goes with --validate"),
    (["--top", "3"], "--top: goes with --search"), (["--repeat", "2"], "--repeat: goes with --measure"),
    (["--out", "somewhere"], "--out: goes with --measure"), (["--tokens", "5"], "--tokens: goes with --inference"),
    (["--tp", "2"], "--tp: goes with --inference"), (["--batch", "2"], "--batch: goes with --inference"),
    (["--hardware", "h100", "-n", "4", "--search", "--cluster", "2x2@1gbit"],
     "--cluster: plans emulated nodes of this machine (its links as calibrated); leave out --hardware"),
    (["--calibrate"], "--calibrate: measures this machine alone; give it with --catalogue and --busy-ok only"),
    (["--notes", "--largest"], "--notes: prints the notes' arithmetic; leave out --search, --validate, --largest "
                               "and --inference"),
    (["--inference", "--tiers"], "--tiers: shapes one plan's text (with --largest, the grown model's); leave out "
                                 "--search, --validate, --inference and --notes"),
    (["--inference", "--tp", "3", "--nodes", "2", "--hardware", "h100", "--network", "ib-hdr"],
     "--tp 3 ranks do not share --nodes 2 evenly: give a multiple of 2 ranks"),
    (["--inference", "--ttft-target", "1.2.3"], None)])
def test_a_plan_option_of_another_mode_is_refused_not_ignored(extra, said, capsys):
    if said is None:  # a value the option's type refuses, in its words
        with pytest.raises(SystemExit):
            cli.main(["plan", "--model", "gpt2", *extra])
        assert capsys.readouterr().err.endswith("expected a duration such as 200ms, 0.5s or 0.2, got '1.2.3'\n")
        return
    assert cli.main(["plan", "--model", "gpt2", *extra]) == 2
    assert capsys.readouterr().err == f"mpitrain: error: {said}" + (" (mpitrain plan CONFIG -n P --search ...)\n"
                                                                      if said.endswith("--search") else "\n")
