"""Every ``mpitrain`` command against the places it writes: its standard output closed, a
read-only output folder, and something of the wrong kind already where its output goes
(a file where a folder is made, a folder where a file is written). Each is one line
naming the place, exit status 2 (or 1 for a disk that fails mid-write), never a
traceback, and nothing half-written left behind.

Before these, ``config reference --out``, ``data build --out``, ``plan --html``,
``plan --json``, ``plan --search --measure --out``, ``plan --calibrate --catalogue`` and
``bench ddp --json`` raised ``OSError`` with a traceback (some after all their work), and
``train`` built its model before it found that its run directory could not be written.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import WORDS, small_text, tmpfs
from test_resume import small as small_gpt

from mpitrain import cli

JOBS = Path(__file__).parents[1] / "jobs"
GPT = str(JOBS / "tinyshakespeare_gpt.toml")


def small(data) -> list[str]:
    return [*small_gpt(data), "--set", "train.steps=2"]


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """(a text file, its shard directory, a finished run of two steps), made once."""
    root = tmp_path_factory.mktemp("made")
    small_text(root / "shards", 400, WORDS[:3])
    src = root / "input.txt"
    run = root / "run"
    assert cli.main(["train", GPT, *small(root / "shards"), "--run-dir", str(run)]) == 0
    return src, root / "shards", run


# each command that writes, with OUT where its output goes, and whether OUT is a folder
WRITERS = {
    "train": (lambda src, data, run: ["train", GPT, *small(data), "--run-dir", "OUT"], True),
    "report": (lambda src, data, run: ["report", str(run), "--out", "OUT"], True),
    "config reference": (lambda src, data, run: ["config", "reference", "--out", "OUT"], False),
    "data build": (lambda src, data, run: ["data", "build", "text", "--src", str(src), "--out", "OUT"], True),
    "data download --out": (lambda src, data, run: ["data", "download", "tinyshakespeare", "--out", "OUT",
                                                     "--mirror", "http://127.0.0.1:9"], True),
    "data download --cache": (lambda src, data, run: ["data", "download", "tinyshakespeare", "--cache", "OUT",
                                                       "--mirror", "http://127.0.0.1:9"], True),
    "plan --html": (lambda src, data, run: ["plan", GPT, *small(data), "--html", "OUT"], False),
    "plan --validate --json": (lambda src, data, run: ["plan", GPT, *small(data), "--validate", "--json", "OUT"],
                               False),
    "plan --search --measure": (lambda src, data, run: ["plan", GPT, *small(data), "-n", "1", "--search",
                                                        "--measure", "1", "--out", "OUT"], True),
    "plan --calibrate": (lambda src, data, run: ["plan", "--calibrate", "--catalogue", "OUT"], False),
    "bench ddp --json": (lambda src, data, run: ["bench", "ddp", "--json", "OUT"], False),
}


def one_line_error(argv, capsys) -> str:
    """Run ``argv``: it must end with status 2 (or 1) and one line on stderr, no traceback
    (any exception but SystemExit would be one); that line."""
    try:
        code = cli.main(argv)
    except SystemExit as e:  # argparse's usage error: its usage, then one error line
        code = e.code
    err = capsys.readouterr().err
    assert code in (1, 2), (argv, code, err)
    errors = [line for line in err.splitlines() if "error" in line]
    assert len(errors) == 1 and "Traceback" not in err, err
    return errors[0]


@pytest.fixture
def read_only(tmp_path):
    """A folder nothing can be written into: a read-only tmpfs for root (whom permissions
    do not stop; skipped where it cannot be mounted), else a folder without write permission."""
    folder = tmp_path / "read-only"
    if os.geteuid() != 0:
        folder.mkdir()
        folder.chmod(0o555)
        yield folder
        folder.chmod(0o755)
        return
    with tmpfs(folder, "ro,size=1m"):
        yield folder


@pytest.mark.parametrize("command", list(WRITERS))
def test_every_output_in_a_read_only_folder_is_one_line_before_any_work(command, made, read_only, capsys):
    argv, _ = WRITERS[command]
    out = read_only / "out"
    line = one_line_error([str(out) if a == "OUT" else a for a in argv(*made)], capsys)
    assert f"{out}: cannot write there (a read-only file system)" in line or \
        f"{out}: cannot write there (no permission" in line or \
        f"{out}: cannot make the report's folder" in line, line  # report's own words
    assert not list(read_only.iterdir())


@pytest.mark.parametrize("command", list(WRITERS))
def test_an_output_of_the_wrong_kind_already_there_is_one_line_and_left_alone(command, made, tmp_path, capsys):
    argv, folder = WRITERS[command]
    out = tmp_path / "taken"
    if folder:
        out.write_text("a file the user keeps\n")
    else:
        out.mkdir()
        (out / "kept").write_text("a file the user keeps\n")
    line = one_line_error([str(out) if a == "OUT" else a for a in argv(*made)], capsys)
    assert str(out) in line and ("is a file" in line or "is a folder" in line or "is not a directory" in line), line
    assert (out.read_text() if folder else (out / "kept").read_text()) == "a file the user keeps\n"


@pytest.mark.parametrize("command", ["config reference", "plan --html"])
def test_an_existing_output_file_is_replaced_whole(command, made, tmp_path, capsys):
    """A file already where a file is written: replaced, with nothing left beside it."""
    argv, _ = WRITERS[command]
    out = tmp_path / "taken.out"
    out.write_text("the old one\n")
    assert cli.main([str(out) if a == "OUT" else a for a in argv(*made)]) == 0
    capsys.readouterr()
    assert out.read_text() != "the old one\n" and [p.name for p in tmp_path.iterdir()] == ["taken.out"]


def test_a_link_is_written_through_and_a_dangling_one_is_one_line(tmp_path, capsys):
    target = tmp_path / "real.md"
    target.write_text("the old one\n")
    link = tmp_path / "link.md"
    link.symlink_to(target)
    assert cli.main(["config", "reference", "--out", str(link)]) == 0
    assert link.is_symlink() and target.read_text().startswith("# Configuration reference")
    dangling = tmp_path / "gone"
    dangling.symlink_to(tmp_path / "nowhere")
    for argv in (["config", "reference", "--out", str(dangling / "x.md")], ["plan", GPT, "--html", str(dangling)]):
        line = one_line_error(argv, capsys)
        assert f"{dangling}: is a link to {tmp_path / 'nowhere'}, which does not exist" in line, line


def test_a_write_that_fails_midway_leaves_nothing_beside_it_and_says_which_file(tmp_path, monkeypatch):
    from mpitrain import output

    target = tmp_path / "page.html"
    target.write_text("the page before")
    real = os.replace
    monkeypatch.setattr(os, "replace", lambda *a: (_ for _ in ()).throw(OSError(28, "No space left on device")))
    with pytest.raises(output.OutputError, match=f"{target}: could not be written \\(No space left on device\\)"):
        output.write_text(target, "the new page")
    monkeypatch.setattr(os, "replace", real)
    assert target.read_text() == "the page before" and sorted(p.name for p in tmp_path.iterdir()) == ["page.html"]
    monkeypatch.setattr(os, "fsync", lambda fd: (_ for _ in ()).throw(KeyboardInterrupt()))  # Ctrl-C mid-write
    with pytest.raises(KeyboardInterrupt):
        output.write_text(target, "the new page")
    assert target.read_text() == "the page before" and sorted(p.name for p in tmp_path.iterdir()) == ["page.html"]


@pytest.mark.parametrize("words", [
    ["train", "CONFIG", "--run-dir", "RUN2"], ["sample", "RUN", "--tokens", "5"], ["eval", "RUN"],
    ["report", "RUN"], ["config", "show", "CONFIG"], ["config", "reference"], ["data", "info", "DATA"],
    ["data", "verify", "DATA"], ["data", "build", "text", "--src", "SRC", "--out", "DATA2"], ["plan", "CONFIG"],
    ["bench", "published"], ["launch", "true"],
    ["cluster", "--help"]])
def test_every_command_with_its_output_closed_runs_to_its_end(words, made, tmp_path):
    """``mpitrain ... >&-``: every command, each doing its real work where it can here
    (``cluster`` needs root and network namespaces: its help)."""
    src, data, run = made
    names = {"CONFIG": GPT, "RUN": str(run), "RUN2": str(tmp_path / "run2"), "DATA": str(data), "SRC": str(src),
             "DATA2": str(tmp_path / "data2")}
    argv = [names.get(w, w) for w in words]
    argv += small(data) if words[0] in ("train", "config", "plan") and "CONFIG" in words else []
    done = subprocess.run([sys.executable, "-m", "mpitrain", *argv], stdin=subprocess.DEVNULL,
                          stderr=subprocess.PIPE, text=True, timeout=120, close_fds=True,
                          preexec_fn=lambda: os.close(1), cwd=tmp_path)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    if words[0] == "train":
        assert json.loads((tmp_path / "run2" / "run.json").read_text())["run"]["id"]
