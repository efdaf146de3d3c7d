"""Resuming never destroys or guesses: checksummed metadata, unusable checkpoints kept
aside, newer formats refused, the run directory and the config a resume takes, write
errors and a full disk while checkpointing.

Each test here failed before the change that made it pass: a flipped step or
RNG state resumed silently, malformed JSON crashed every rank, a resume with no usable
checkpoint started over and deleted the newer files, ``CONFIG --resume`` continued the
wrong run, the saved ``--set`` values were dropped, and a full disk crashed the run.
"""

import contextlib
import errno
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import h5py
import pytest
from conftest import tmpfs
from test_checkpoint import assert_identical, damage, gpt, quiet
from test_train import JOBS

from mpitrain import checkpoint, cli, train
from mpitrain.config import ConfigError
from mpitrain.train import identity


def rewrite_attr(path, name, value):
    """Change one attribute as a damaged disk or an editor would: without the header."""
    with h5py.File(path, "r+") as f:
        f.attrs[name] = value


def rewrite_header(path, **changes):
    """The header of a checkpoint with ``changes``, as a later mpitrain would write it."""
    data = path.read_bytes()
    fields = {**checkpoint.format.read_header(path), **changes}
    path.write_bytes(checkpoint.format.header_bytes(fields).ljust(fields["userblock"], b"\0") + data[fields["userblock"]:])


def without_header(path, version=1):
    """The checkpoint as format version 1 wrote it: the HDF5 file alone."""
    old = path.with_suffix(".old")
    with h5py.File(path, "r") as src, h5py.File(old, "w") as dst:
        for name in src:
            src.copy(name, dst)
        dst.attrs.update({k: v for k, v in src.attrs.items()})
        dst.attrs["format_version"] = version
    old.replace(path)


def three_checkpoints(text_data, run):
    train.train(gpt(text_data, run, "train.steps=12"), log=quiet)  # checkpoints 4, 8, 12
    return [checkpoint.path_for(run, s) for s in (4, 8, 12)]


@pytest.mark.parametrize("name,value", [("step", 8), ("epoch_step", 3), ("rng", '{"seed": 1}'),
                                        ("config", "{not json"), ("format_version", 3), ("optimizer", "[]")])
def test_changed_metadata_is_caught_and_the_resume_takes_the_previous_checkpoint(text_data, tmp_path, name, value):
    run = tmp_path / "a"
    newest = three_checkpoints(text_data, run)[-1]
    rewrite_attr(newest, name, value)
    with pytest.raises(checkpoint.CheckpointError, match=f"{newest}: damaged"):
        checkpoint.check(newest)
    warnings = []
    again = train.train(gpt(text_data, run, "train.steps=12"), log=quiet, warn=warnings.append, resume=True)
    assert again.start_step == 8 and warnings[0].startswith(f"warning: cannot resume from {newest}: damaged")


def test_a_flag_of_the_optimizer_state_flipped_is_caught(text_data, tmp_path):
    """optim/has_state said which parameters have Adam state: a flipped one reset it."""
    newest = three_checkpoints(text_data, tmp_path / "a")[-1]
    with h5py.File(newest, "r+") as f:
        f["optim/has_state"][0] = False
    with pytest.raises(checkpoint.CheckpointError, match="damaged: its bytes do not match the SHA-256"):
        checkpoint.check(newest)


def test_a_file_renamed_over_another_step_is_caught(text_data, tmp_path):
    first, _, newest = three_checkpoints(text_data, tmp_path / "a")
    shutil.copy(first, newest)
    with pytest.raises(checkpoint.CheckpointError, match="holds step 4, not the step its name says"):
        checkpoint.check(newest)


def test_a_newer_format_is_refused_naming_both_versions_and_nothing_moves(text_data, tmp_path):
    run = tmp_path / "a"
    paths = three_checkpoints(text_data, run)
    rewrite_header(paths[-1], format_version=checkpoint.FORMAT_VERSION + 1)
    message = f"format version {checkpoint.FORMAT_VERSION + 1} .* reads versions up to {checkpoint.FORMAT_VERSION}"
    with pytest.raises(checkpoint.CheckpointNewer, match=message):
        train.train(gpt(text_data, run, "train.steps=12"), log=quiet, warn=quiet, resume=True)
    assert checkpoint.listed(run) == paths and not (run / "checkpoints" / "unusable").exists()


def seal(path, body: bytes):
    """Replace a checkpoint's header with ``body`` under a matching SHA-256 line: an
    edit by hand that was sealed again."""
    import hashlib

    block = checkpoint.format.read_header(path)["userblock"]
    data = path.read_bytes()
    head = checkpoint.format.MAGIC + body + b"\n" + checkpoint.format.HASH_LINE + hashlib.sha256(body).hexdigest().encode() + b"\n"
    path.write_bytes(head.ljust(block, b"\0") + data[block:])


@pytest.mark.parametrize("edit, message", [
    (lambda f: [], "not a JSON object"),
    (lambda f: {**f, "format_version": "3"}, "'format_version' is '3', not a non-negative integer"),
    (lambda f: {k: v for k, v in f.items() if k != "step"}, "'step' is None"),
    (lambda f: {k: v for k, v in f.items() if k != "config"}, "'config' is None, not a dict"),
    (lambda f: {**f, "file_bytes": True}, "'file_bytes' is True"),
    (lambda f: {**f, "file_sha256": "ab"}, "'file_sha256' is not a SHA-256"),
    (lambda f: b"\xff{", "not JSON"),
], ids=["list", "version string", "no step", "no config", "bool size", "short digest", "not utf-8"])
def test_a_resealed_header_that_lacks_a_field_is_damaged_not_a_traceback(text_data, tmp_path, edit, message):
    run = tmp_path / "a"
    newest = three_checkpoints(text_data, run)[-1]
    edited = edit(checkpoint.format.read_header(newest))
    seal(newest, edited if isinstance(edited, bytes) else json.dumps(edited).encode())
    for reader in (checkpoint.check, checkpoint.read_meta):
        with pytest.raises(checkpoint.CheckpointError, match=f"{newest}: damaged: .*{message}"):
            reader(newest)
    warnings = []
    again = train.train(gpt(text_data, run, "train.steps=12"), log=quiet, warn=warnings.append, resume=True)
    assert again.start_step == 8 and warnings[0].startswith(f"warning: cannot resume from {newest}: damaged")


def test_with_no_usable_checkpoint_a_resume_stops_listing_each_unless_asked_to_start_over(text_data, tmp_path):
    run = tmp_path / "a"
    paths = three_checkpoints(text_data, run)
    for path, how in zip(paths, ["truncated", "flipped", "garbage"]):
        damage(path, how)
    before = {p: p.read_bytes() for p in paths}
    with pytest.raises(checkpoint.CheckpointError) as caught:
        train.train(gpt(text_data, run, "train.steps=12"), log=quiet, warn=quiet, resume=True)
    message = str(caught.value)
    assert all(str(p) in message for p in paths) and "add --start-over" in message
    assert {p: p.read_bytes() for p in paths} == before  # nothing deleted, nothing moved
    warnings = []
    again = train.train(gpt(text_data, run, "train.steps=12"), log=quiet, warn=warnings.append, resume=True,
                        start_over=True)
    assert again.start_step == 0 and again.steps == 12 and len(warnings) == 3
    assert {(run / "checkpoints" / "unusable" / p.name).read_bytes() for p in paths} == set(before.values())


def test_a_checkpoint_of_format_version_1_still_resumes_with_a_note(text_data, tmp_path):
    run = tmp_path / "a"
    three_checkpoints(text_data, run)
    for path in checkpoint.listed(run):
        without_header(path)
    lines = []
    train.train(gpt(text_data, run, "train.steps=12"), log=lines.append, resume=True)
    assert any("at step 12" in line and "format version 1: its metadata has no checksum" in line for line in lines)


def test_a_format_version_1_checkpoint_is_checked_to_its_last_array(text_data, tmp_path):
    """A header-less (format 1) file's arrays are all read when it is checked: damage in
    the last one is found, not only in the first (h5py's visit stops at a returned value)."""
    path = three_checkpoints(text_data, tmp_path / "a")[-1]
    without_header(path)
    checkpoint.check(path)
    with h5py.File(path, "r") as f:
        arrays = []
        f.visititems(lambda name, obj: arrays.append(obj) if isinstance(obj, h5py.Dataset) and obj.size > 1 else None)
        last = arrays[-1]
        offset = last.id.get_offset() if last.chunks is None else last.id.get_chunk_info(0).byte_offset
    data = bytearray(path.read_bytes())
    data[offset + 3] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(checkpoint.CheckpointError):
        checkpoint.check(path)


# ------------------------------------------------------------- write errors
def test_a_failed_write_leaves_no_temporary_file_and_the_previous_checkpoint_intact(text_data, tmp_path,
                                                                                   monkeypatch):
    run = tmp_path / "a"
    full = tmp_path / "full"
    train.train(gpt(text_data, full, "train.steps=12"), log=quiet)
    real_fsync = os.fsync

    def full_disk(fd):
        if Path(os.readlink(f"/proc/self/fd/{fd}")).name == "step-00000008.h5.tmp":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_fsync(fd)

    monkeypatch.setattr(os, "fsync", full_disk)
    with pytest.raises(checkpoint.CheckpointWriteError) as caught:
        train.train(gpt(text_data, run, "train.steps=12"), log=quiet)
    assert str(caught.value) == (f"{checkpoint.path_for(run, 8)}: could not be written (No space left on device); "
                                 f"the previous checkpoint, {checkpoint.path_for(run, 4)}, is intact")
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-00000004.h5"]
    monkeypatch.setattr(os, "fsync", real_fsync)
    checkpoint.check(checkpoint.path_for(run, 4))
    train.train(gpt(text_data, run, "train.steps=12"), log=quiet, resume=True)
    assert_identical(checkpoint.path_for(full, 12), checkpoint.path_for(run, 12))


def test_a_ctrl_c_during_the_last_checkpoint_write_does_not_interrupt_it(text_data, tmp_path, monkeypatch):
    """With checkpoint_interval = 0 the end-of-training checkpoint is the run's only
    one: a first Ctrl-C while it is written (after the loop) waits for it."""
    import signal
    import time

    real_write = checkpoint._write

    def interrupted(*args):
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.01)  # the handler runs here, between two bytecodes
        return real_write(*args)

    monkeypatch.setattr(checkpoint, "_write", interrupted)
    done = train.train(gpt(text_data, tmp_path / "a", "train.steps=6", "run.checkpoint_interval=0"), log=quiet)
    assert done.steps == 6 and checkpoint.listed(tmp_path / "a") == [checkpoint.path_for(tmp_path / "a", 6)]
    checkpoint.check(checkpoint.path_for(tmp_path / "a", 6))


def test_the_half_written_file_of_a_killed_write_goes_at_the_next_checkpoint(text_data, tmp_path):
    """A second Ctrl-C, or SIGKILL, during a write leaves ``step-N.h5.tmp``: a resume
    ignores it, and the next checkpoint written removes it."""
    run = tmp_path / "a"
    train.train(gpt(text_data, run, "train.steps=8"), log=quiet)
    stale = run / "checkpoints" / "step-00000010.h5.tmp"
    stale.write_bytes(b"half a checkpoint")
    train.train(gpt(text_data, run, "train.steps=12"), log=quiet, resume=True)
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == [f"step-0000000{s}.h5" for s in (4, 8)] + [
        "step-00000012.h5"]


@pytest.fixture
def tiny_disk(tmp_path):
    """A 3 MiB tmpfs (root and mount needed: skipped otherwise), unmounted after."""
    with tmpfs(tmp_path / "disk", "size=3m") as mount:
        yield mount


def test_a_full_disk_while_checkpointing_is_one_message_then_resume_works(text_data, tiny_disk, tmp_path):
    """The real thing: the GPT's checkpoints are about 1 MB, so the third one does not fit."""
    run = tiny_disk / "run"
    cmd = [sys.executable, "-m", "mpitrain", "train", str(JOBS / "tinyshakespeare_gpt.toml"),
           "--set", f"data.path={text_data}", "--set", "model.n_layer=2", "--set", "model.n_embd=64",
           "--set", "model.n_head=2", "--set", "model.block_size=16", "--set", "train.steps=12",
           "--set", "train.eval_batches=1", "--set", "train.sample_tokens=0", "--set", "run.checkpoint_interval=2",
           "--set", "run.keep=5", "--set", "train.threads=1", "--run-dir", str(run)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stderr
    errors = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(errors) == 1 and "could not be written (No space left on device); the previous checkpoint" in \
        errors[0], done.stderr
    kept = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert kept and not [k for k in kept if not k.endswith(".h5")], kept
    for path in checkpoint.listed(run):
        checkpoint.check(path)
    # room again (the earlier ones moved away): the run resumes from the newest that fits
    newest = checkpoint.listed(run)[-1]
    for path in checkpoint.listed(run)[:-1]:
        path.unlink()
    again = subprocess.run(cmd[:4] + ["--resume", str(run), "--set", "run.keep=1"], capture_output=True,
                           text=True, timeout=120)
    assert again.returncode == 0, again.stderr
    assert f"resumed from {newest}" in again.stdout


# ---------------------------------------------------------- the command line
def cli_run(*argv, capsys):
    code = cli.main(["train", *map(str, argv)])
    out, err = capsys.readouterr()
    return code, out, err


def small(text_data):
    return ["--set", f"data.path={text_data}", "--set", "model.n_layer=1", "--set", "model.n_embd=16",
            "--set", "model.n_head=2", "--set", "model.block_size=8", "--set", "train.global_batch_size=8",
            "--set", "train.eval_batches=1", "--set", "train.sample_tokens=0", "--set", "train.threads=1"]


def test_config_resume_refuses_to_choose_between_two_runs(text_data, tmp_path, monkeypatch, capsys):
    """A finished run in runs/<name> and one stopped before its first checkpoint in
    runs/<name>-2: which to continue is the user's to say."""
    monkeypatch.chdir(tmp_path)
    config = JOBS / "tinyshakespeare_gpt.toml"
    assert cli_run(config, *small(text_data), "--set", "train.steps=4", capsys=capsys)[0] == 0
    (tmp_path / "runs" / "tinyshakespeare_gpt-2").mkdir()  # where the second run went
    code, out, err = cli_run(config, *small(text_data), "--set", "train.steps=8", "--resume", capsys=capsys)
    assert code == 2
    assert err.strip() == ("mpitrain: error: --resume: 2 runs of tinyshakespeare_gpt: runs/tinyshakespeare_gpt "
                           "(newest checkpoint step 4); runs/tinyshakespeare_gpt-2 (no checkpoint); say which to "
                           "resume: mpitrain train --resume runs/tinyshakespeare_gpt-2")
    code, out, err = cli_run("--resume", "runs/tinyshakespeare_gpt", "--set", "train.steps=8", capsys=capsys)
    assert code == 0, err
    assert "resumed from runs/tinyshakespeare_gpt/checkpoints/step-00000004.h5 at step 4" in out
    assert "resume: changes to the saved config: train.steps = 8 (saved: 4)" in err


def test_a_resume_keeps_the_saved_overrides_lists_new_ones_and_refuses_another_model(text_data, tmp_path,
                                                                                   monkeypatch, capsys):
    """jobs/README.md's example: a run started with --set run.checkpoint_interval=2 and
    resumed without it still checkpoints every 2 steps."""
    monkeypatch.chdir(tmp_path)
    config = JOBS / "tinyshakespeare_gpt.toml"
    code, _, err = cli_run(config, *small(text_data), "--set", "train.steps=4", "--set", "run.checkpoint_interval=2",
                           "--run-dir", "runs/b", capsys=capsys)
    assert code == 0, err
    code, out, err = cli_run(config, "--resume", "runs/b", "--set", "train.steps=8", capsys=capsys)
    assert code == 0, err
    assert [p.name for p in checkpoint.listed("runs/b")] == [f"step-{s:08d}.h5" for s in (4, 6, 8)]
    saved = checkpoint.check(checkpoint.path_for("runs/b", 8))["json"]["config"]
    assert saved["run"]["checkpoint_interval"] == 2 and saved["train"]["steps"] == 8
    assert "resume: changes to the saved config: train.steps = 8 (saved: 4)\n" in err
    note = next(line for line in err.splitlines() if line.startswith("note: "))
    assert "differs from the config saved in runs/b/checkpoints/step-00000004.h5: " in note
    assert "data.path = 'runs/data/tinyshakespeare' in the file" in note and "train.steps" not in note
    code, out, err = cli_run("--resume", "runs/b", "--set", "model.n_embd=32", capsys=capsys)
    assert code == 2 and "the checkpoint's model differs: model.n_embd = 32 (saved: 16)" in err


def test_a_config_read_from_a_checkpoint_whose_arrays_are_damaged_is_not_used(text_data, tmp_path, monkeypatch,
                                                                               capsys):
    """The command line reads the config from the newest checkpoint's header, which
    verifies; its arrays do not, so the state comes from the one before, and so does the
    config: the one saved with that state, with this command's --set as changes."""
    monkeypatch.chdir(tmp_path)
    config = JOBS / "tinyshakespeare_gpt.toml"
    code, _, err = cli_run(config, *small(text_data), "--set", "train.steps=4", "--set", "run.checkpoint_interval=2",
                           "--run-dir", "runs/b", capsys=capsys)
    assert code == 0, err
    code, _, err = cli_run("--resume", "runs/b", "--set", "train.steps=6", "--set", "optim.lr=2e-3", capsys=capsys)
    assert code == 0, err
    newest = checkpoint.path_for("runs/b", 6)
    damage(newest, "flipped")
    code, out, err = cli_run("--resume", "runs/b", "--set", "train.steps=8", capsys=capsys)
    assert code == 0, err
    assert err.count("moved to") == 1 and f"moved to runs/b/checkpoints/unusable/{newest.name}" in err
    assert f"resume: the config saved in {checkpoint.path_for('runs/b', 4)} (the checkpoint resumed)" in out
    assert "resume: changes to the saved config: train.steps = 8 (saved: 4)\n" in err  # and not lr 2e-3's
    assert f"resumed from {checkpoint.path_for('runs/b', 4)} at step 4" in out
    assert checkpoint.check(checkpoint.path_for("runs/b", 8))["json"]["config"]["optim"]["lr"] == 1e-3


@pytest.mark.parametrize("how", ["flipped", "truncated"])
def test_one_resume_command_goes_past_a_damaged_newest_checkpoint_bit_identically(text_data, tmp_path,
                                                                                monkeypatch, capsys, how):
    """A run stopped after its step-6 checkpoint, whose arrays are then damaged: one
    ``--resume`` sets it aside and ends where the uninterrupted run ended, to the bit."""
    monkeypatch.chdir(tmp_path)
    config = JOBS / "tinyshakespeare_gpt.toml"
    code, _, err = cli_run(config, *small(text_data), "--set", "train.steps=8", "--set", "run.checkpoint_interval=2",
                           "--set", "run.keep=10", "--run-dir", "runs/a", capsys=capsys)
    assert code == 0, err
    shutil.copytree("runs/a", "runs/b")
    checkpoint.path_for("runs/b", 8).unlink()  # the run b: stopped at step 6
    damage(checkpoint.path_for("runs/b", 6), how)
    code, out, err = cli_run("--resume", "runs/b", capsys=capsys)
    assert code == 0, err
    assert err.count("moved to") == 1 and f"resumed from {checkpoint.path_for('runs/b', 4)} at step 4" in out
    assert_identical(checkpoint.path_for("runs/a", 8), checkpoint.path_for("runs/b", 8))


def test_a_checkpoint_of_another_run_at_a_step_this_run_writes_is_moved_aside_not_written_over(text_data,
                                                                                              tmp_path):
    other = tmp_path / "other"
    train.train(gpt(text_data, other, "train.steps=8", "train.seed=2"), log=quiet)
    run = tmp_path / "a"
    train.train(gpt(text_data, run, "train.steps=4", "run.keep=1"), log=quiet)
    shutil.copy(checkpoint.path_for(other, 8), checkpoint.directory(run))
    theirs = checkpoint.path_for(other, 8).read_bytes()
    said, warned = [], []
    again = train.train(gpt(text_data, run, "train.steps=12", "run.keep=1"), log=said.append, warn=warned.append,
                        resume=True)
    assert again.start_step == 4
    assert any(w.startswith(f"resume: {checkpoint.path_for(run, 8)} is a checkpoint of another run ")
               and "train.seed = 2 (this run: 1337)" in w for w in warned), warned
    aside = checkpoint.directory(run) / "other-runs" / "step-00000008.h5"
    assert f"warning: {checkpoint.path_for(run, 8)} is not this run's checkpoint: moved to {aside}" in said
    assert aside.read_bytes() == theirs
    assert checkpoint.listed(run) == [checkpoint.path_for(run, 12)]  # this run's, the newest keep = 1


def test_checkpoints_of_two_runs_without_run_json_are_refused_naming_both(text_data, tmp_path):
    """Without run.json nothing says which run the directory holds: no guess."""
    for name, steps in (("a", 4), ("b", 8)):
        train.train(gpt(text_data, tmp_path / name, f"train.steps={steps}"), log=quiet)
    shutil.copy(checkpoint.path_for(tmp_path / "b", 8), checkpoint.directory(tmp_path / "a"))
    (tmp_path / "a" / "run.json").unlink()
    with pytest.raises(checkpoint.CheckpointError, match=r"checkpoints of 2 runs, and no .*run.json to say which "
                                                         r"run this is: run [0-9a-f]{16} \(started .*\): steps 4; "
                                                         r"run [0-9a-f]{16} \(started .*\): steps 8"):
        train.train(gpt(text_data, tmp_path / "a", "train.steps=8"), log=quiet, resume=True)


def test_a_damaged_run_json_is_one_message_and_copied_checkpoints_name_their_run(text_data, tmp_path):
    run = tmp_path / "a"
    train.train(gpt(text_data, run, "train.steps=4"), log=quiet)
    ident = identity.read(run)
    assert ident == identity.of(checkpoint.header(checkpoint.path_for(run, 4)))
    assert ident["config_sha256"] == identity.config_digest(gpt(text_data, tmp_path / "elsewhere",
                                                                "train.steps=4").to_dict())
    (run / "run.json").write_text((run / "run.json").read_text().replace(ident["id"], "0" * 16))
    with pytest.raises(checkpoint.CheckpointError, match="run.json: damaged"):
        train.train(gpt(text_data, run, "train.steps=8"), log=quiet, resume=True)
    copy = tmp_path / "b"  # only the checkpoints, copied elsewhere: the run they name
    shutil.copytree(checkpoint.directory(run), checkpoint.directory(copy))
    assert train.train(gpt(text_data, copy, "train.steps=8"), log=quiet, resume=True).start_step == 4
    assert identity.read(copy) == ident


def test_resume_arguments_that_cannot_be_meant_are_refused(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    config = str(JOBS / "tinyshakespeare_gpt.toml")
    for argv, message in [(["--resume", config], "--resume takes a run directory, not the file"),
                          ([config, "--start-over"], "--start-over applies with --resume"),
                          (["--resume", "runs/a", "--run-dir", "runs/b"], "name different run directories"),
                          ([], "the CONFIG file is required"),
                          ([config, "--from", "x.h5", "--resume"], "--from starts a new run from a checkpoint's "
                                                                   "weights; --resume continues a run: give one"),
                          (["--from", "x.h5"], "--from needs the CONFIG file of the new run"),
                          ([config, "--from", "."], "--from takes a checkpoint file, not the directory .")]:
        with pytest.raises(SystemExit) as stop:
            cli.main(["train", *argv])
        assert stop.value.code == 2 and message in capsys.readouterr().err
    for argv in (["--resume", "runs/typo"], [config, "--resume", "runs/typo"]):  # a typo starts nothing
        assert cli.main(["train", *argv]) == 2
        assert "--resume runs/typo: no such run directory" in capsys.readouterr().err
    assert not Path("runs/typo").exists()
    assert cli.main(["train", config, "--from", "runs/typo.h5"]) == 2
    assert "--from runs/typo.h5: no such checkpoint file" in capsys.readouterr().err
    Path("runs/none").mkdir(parents=True)
    assert cli.main(["train", "--resume", "runs/none"]) == 2
    assert "holds no usable checkpoint to take the config from; give the CONFIG file too" in capsys.readouterr().err


def test_config_resume_finds_a_run_past_a_gap_left_by_a_deleted_one(tmp_path):
    from mpitrain.train import resume

    for name in ("gpt-3", "gpt-x", "gpt-03", "other", "gpt-12"):
        (tmp_path / name).mkdir()
    assert resume.runs_of("gpt", tmp_path) == [tmp_path / "gpt-3", tmp_path / "gpt-12"]
    with pytest.raises(ConfigError, match="2 runs of gpt"):
        resume.find_run("gpt", tmp_path)
    (tmp_path / "gpt-12").rmdir()
    assert resume.find_run("gpt", tmp_path)[0] == tmp_path / "gpt-3"


def test_config_errors_in_a_saved_config_name_the_checkpoint(text_data, tmp_path):
    from mpitrain import config

    run = tmp_path / "a"
    newest = three_checkpoints(text_data, run)[-1]
    saved = checkpoint.check(newest)["json"]["config"]
    saved["optim"]["lr"] = -1.0
    with pytest.raises(ConfigError, match=r"^the saved config: optim.lr: must be > 0"):
        config.from_saved(saved)
    assert config.from_saved(json.loads(json.dumps(saved)), ["optim.lr=0.5"]).optim.lr == 0.5


def test_a_resume_on_other_data_is_said(text_data, tmp_path):
    from mpitrain_datasets import text

    run = tmp_path / "a"
    train.train(gpt(text_data, run, "train.steps=4"), log=quiet)
    src = tmp_path / "other.txt"
    src.write_text("\n".join(["or not", "to be", "the question", "that is"] * 150) + "\n")  # the same characters
    text.text(src, tmp_path / "other")
    warnings = []
    train.train(gpt(tmp_path / "other", run, "train.steps=8"), log=quiet, warn=warnings.append, resume=True)
    said = [w for w in warnings if "was trained on" in w]
    assert len(said) == 1 and said[0].startswith(f"warning: {checkpoint.path_for(run, 4)} was trained on ")
    warnings.clear()
    train.train(gpt(text_data, tmp_path / "b", "train.steps=4"), log=quiet)
    train.train(gpt(text_data, tmp_path / "b", "train.steps=8"), log=quiet, warn=warnings.append, resume=True)
    assert not [w for w in warnings if "was trained on" in w]


def test_a_field_newer_than_the_saved_config_is_a_change_only_off_its_default():
    """A checkpoint of an older mpitrain lacks the fields added since: at their defaults
    the run is the one it saved, so a resume says nothing of them."""
    from mpitrain.config import Config
    from mpitrain.config import changes as config_changes

    now = Config().to_dict()
    saved = {section: {k: v for k, v in table.items() if k != "eval_flip"} for section, table in now.items()}
    assert config_changes(saved, now) == []
    assert config_changes(saved, {**now, "train": {**now["train"], "eval_flip": True}}) == [
        ("train.eval_flip", None, True)]
    dropped = {**now, "train": {k: v for k, v in now["train"].items() if k != "seed"}}
    assert config_changes(now, dropped) == [("train.seed", 1337, None)]


def test_a_pipeline_or_slicing_field_is_dropped_with_a_note_when_the_resume_leaves_that_axis():
    """A ZB-H1 run moved to pp = 1, a sequence-parallel one to tp = 1: the saved fields
    only that axis reads are dropped (a note each), never refused; given ones still count."""
    from mpitrain import config

    saved = config.from_dict({"model": {"name": "gpt", "n_head": 4}, "data": {"name": "shakespeare"},
                              "train": {"steps": 4, "micro_batches": 2},
                              "parallel": {"pp": 2, "tp": 2, "schedule": "zb-h1", "sequence_parallel": True,
                                           "sync": "zero1"}}, data_needed=False).to_dict()
    moved = config.from_saved(json.loads(json.dumps(saved)), ["parallel.pp=1", "parallel.tp=1"], data_needed=False)
    assert (moved.parallel.pp, moved.parallel.tp, moved.parallel.schedule, moved.parallel.sequence_parallel) == (
        1, 1, "1f1b", False)
    assert [n.split(" of ")[0] for n in moved.notes] == ["note: parallel.schedule = 'zb-h1'",
                                                        "note: parallel.sequence_parallel = True"]
    assert config.check_ranks(moved, 1) == (1, 1, 1)
    kept = config.from_saved(json.loads(json.dumps(saved)), ["parallel.tp=1"], data_needed=False)
    assert kept.parallel.schedule == "zb-h1" and len(kept.notes) == 1  # the pipeline stays: its schedule too
    with pytest.raises(ConfigError, match="parallel.schedule: applies to pipeline runs"):
        config.check_ranks(config.from_saved(json.loads(json.dumps(saved)), ["parallel.pp=1",
                                                                             "parallel.schedule='gpipe'"],
                                             data_needed=False), 2)


def test_a_full_disk_when_run_json_is_first_written_is_one_line_then_the_run_starts(text_data, tiny_disk):
    """Before: an OSError traceback on every rank, and an empty run.json.tmp left behind."""
    filler = tiny_disk / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT)
    with contextlib.suppress(OSError):  # the disk full to its last byte
        while True:
            os.write(fd, b"\0" * 4096)
    os.close(fd)
    run = tiny_disk / "run"
    cmd = [sys.executable, "-m", "mpitrain", "train", str(JOBS / "tinyshakespeare_gpt.toml"), *small(text_data),
           "--set", "train.steps=2", "--run-dir", str(run)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.strip() == (f"mpitrain: error: {run / 'run.json'}: could not be written (No space left on "
                                   "device); the run starts by writing it, so nothing was trained: make room, then "
                                   "run the same command again")
    assert list(run.iterdir()) == []  # no temporary file beside it
    filler.unlink()  # room again: the same command runs
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert again.returncode == 0, again.stderr
    assert identity.read(run)["id"] == identity.of(checkpoint.header(checkpoint.path_for(run, 2)))["id"]


def test_metrics_that_cannot_be_written_are_said_once_and_the_run_goes_on(text_data, tmp_path, monkeypatch):
    """The metrics file only reports: a disk that refuses it costs the records, not the run."""
    from mpitrain.observe import metrics

    real = open

    def refusing(path, *args, **kwargs):
        if str(path).endswith("metrics.jsonl") and args[:1] == ("a",):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(path, *args, **kwargs)

    monkeypatch.setattr(metrics, "open", refusing, raising=False)
    warned = []
    result = train.train(gpt(text_data, tmp_path / "a", "train.steps=8"), log=quiet, warn=warned.append)
    assert result.steps == 8 and checkpoint.listed(tmp_path / "a")[-1] == checkpoint.path_for(tmp_path / "a", 8)
    lost = [w for w in warned if "metrics.jsonl: could not be written" in w]
    assert lost == [f"warning: {tmp_path / 'a' / 'metrics.jsonl'}: could not be written (No space left on device); "
                    "its records end before this start record (step 0), and the run goes on without it"], warned
    assert (tmp_path / "a" / "metrics.jsonl").read_text() == ""


def test_resume_of_a_runs_checkpoints_folder_names_the_run_and_starts_nothing(text_data, tmp_path, monkeypatch,
                                                                               capsys):
    """Before: ``--resume RUN/checkpoints`` started a new step-0 run inside checkpoints/."""
    monkeypatch.chdir(tmp_path)
    train.train(gpt(text_data, tmp_path / "runs" / "a", "train.steps=4"), log=quiet)
    folder = Path("runs/a/checkpoints")
    before = sorted(p.name for p in folder.iterdir())
    for argv, option in ((["--resume", str(folder)], "--resume"),
                         ([str(JOBS / "tinyshakespeare_gpt.toml"), "--run-dir", str(folder)], "--run-dir")):
        with pytest.raises(SystemExit) as stop:
            cli.main(["train", *argv])
        assert stop.value.code == 2
        assert (f"{option} {folder} is the checkpoints folder of the run runs/a: give the run directory, "
                f"{option} runs/a") in capsys.readouterr().err
    assert sorted(p.name for p in folder.iterdir()) == before
    assert cli.main(["eval", str(folder), "--json"]) == 0  # reading it: the run it holds
    assert json.loads(capsys.readouterr().out)["checkpoint"] == str(checkpoint.path_for("runs/a", 4))


def test_a_run_json_copied_in_from_another_run_is_overruled_by_the_checkpoints(text_data, tmp_path):
    """Before: every own checkpoint was "another run's", and the resume began again at step 0."""
    run, other = tmp_path / "a", tmp_path / "b"
    train.train(gpt(text_data, run, "train.steps=4"), log=quiet)
    train.train(gpt(text_data, other, "train.steps=4", "train.seed=2"), log=quiet)
    ours, theirs = identity.read(run), identity.read(other)
    shutil.copy(other / "run.json", run / "run.json")
    warned = []
    again = train.train(gpt(text_data, run, "train.steps=8"), log=quiet, warn=warned.append, resume=True)
    assert again.start_step == 4 and identity.read(run) == ours
    kept = run / f"run.json.{theirs['id']}"
    assert json.loads(kept.read_text())["run"] == theirs  # the other record kept, not deleted
    assert [w for w in warned if w.startswith(f"resume: {run / 'run.json'} named run {theirs['id']}")
            and f"every one is run {ours['id']}'s" in w and str(kept) in w], warned


def test_a_runs_own_run_json_stands_when_only_another_runs_checkpoints_are_there(text_data, tmp_path):
    """A run killed before its first checkpoint, another run's checkpoint copied in: the
    run's own record (its metrics.jsonl says so) keeps the other file out; with nothing
    to say which, the resume is refused, naming both."""
    run, other = tmp_path / "a", tmp_path / "b"
    train.train(gpt(text_data, run, "train.steps=4"), log=quiet)
    for path in checkpoint.listed(run):  # as if killed before its first checkpoint
        path.unlink()
    train.train(gpt(text_data, other, "train.steps=4", "train.seed=2"), log=quiet)
    ours, theirs = identity.read(run), identity.read(other)
    shutil.copy(checkpoint.path_for(other, 4), checkpoint.directory(run))
    warned = []
    again = train.train(gpt(text_data, run, "train.steps=4"), log=quiet, warn=warned.append, resume=True)
    assert again.start_step == 0 and identity.read(run) == ours
    assert any("is a checkpoint of another run" in w for w in warned), warned
    assert identity.of(checkpoint.header(checkpoint.directory(run) / "other-runs" / "step-00000004.h5")) == theirs
    checkpoint.directory(tmp_path / "c").mkdir(parents=True)
    shutil.copy(checkpoint.path_for(other, 4), checkpoint.directory(tmp_path / "c"))  # no metrics.jsonl to decide
    shutil.copy(run / "run.json", tmp_path / "c" / "run.json")
    with pytest.raises(checkpoint.CheckpointError, match=f"run.json names run {ours['id']} .* every checkpoint in "
                                                         f".* is run {theirs['id']}'s .* does not say which run"):
        train.train(gpt(text_data, tmp_path / "c", "train.steps=8"), log=quiet, resume=True)
