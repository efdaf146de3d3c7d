"""The command line of training and of using a trained run: ``mpitrain train``,
``mpitrain sample`` and ``mpitrain eval`` (their parsers, and the functions that run
them). The top-level parser, its errors and the other commands: :mod:`mpitrain.cli`,
whose :func:`~mpitrain.cli.build_parser` adds these (:func:`add_parsers`).
"""

from __future__ import annotations

import dataclasses
import io
import itertools
import json
import sys
from pathlib import Path

from mpitrain.cli_common import INTERRUPTED, _failure, _non_negative, _note, _positive, _positive_float, _usage


def add_parsers(commands) -> None:
    for add in (_train_parser, _sample_parser, _eval_parser):
        add(commands)


def _train(args) -> int:
    from mpitrain import train
    from mpitrain.comm import world

    cfg, config_from, reconfigure = _train_config(args)  # before any MPI work
    # each progress line as it is printed, also into a pipe (mpiexec's) or a log file
    # (SLURM's), which Python would otherwise fill 8 KB at a time
    if isinstance(sys.stdout, io.TextIOWrapper):  # not a stream a caller put there (a notebook's)
        sys.stdout.reconfigure(line_buffering=True)
    par = cfg.parallel
    result = train.train(cfg, comm=world(par.thread_level, comm_thread=par.progress == "thread"),
                         resume=args.resume is not None, start_over=args.start_over, config_from=config_from,
                         reconfigure=reconfigure, origin=args.origin)
    return INTERRUPTED if result.stopped == "SIGINT" else 0


def _train_config(args):
    """(the config ``train`` runs, the checkpoint it was read from or None, how to read
    another checkpoint's): a new run's from CONFIG and ``--set``; a resumed run's from its
    newest checkpoint whose header verifies, with ``--set`` as changes
    (:mod:`mpitrain.train.resume`)."""
    from mpitrain import config
    from mpitrain.train import resume

    if args.start_over and args.resume is None:
        raise _usage("--start-over applies with --resume")
    if args.origin is not None:
        _check_origin(args)
    if args.resume is None or args.resume is True and args.run_dir is None:
        if args.config is None:
            raise _usage("the CONFIG file is required (or --resume RUN_DIR)")
        if Path(args.config).is_dir():
            raise _usage(f"{args.config} is a directory: to resume a run, mpitrain train --resume {args.config}")
    if args.run_dir is not None:
        _not_the_checkpoints_folder(args.run_dir, "--run-dir")
    if args.resume is None:
        overrides = args.set + ([f"run.dir={json.dumps(args.run_dir)}"] if args.run_dir is not None else [])
        cfg = config.load(args.config, overrides)
        if "run.dir" not in cfg.given:
            run = dataclasses.replace(cfg.run, dir=str(_new_run_dir(Path(args.config).stem)))
            cfg = dataclasses.replace(cfg, run=run)
        return cfg, None, None
    run_dir = _resume_dir(args)
    overrides = args.set + [f"run.dir={json.dumps(str(run_dir))}"]
    saved = resume.saved_config(run_dir, args.start_over)
    if saved is None:  # nothing to resume: the run starts from CONFIG
        if args.config is None:
            raise _failure(f"{run_dir}: holds no usable checkpoint to take the config from; give the CONFIG "
                           "file too")
        return config.load(args.config, overrides), None, None
    path, saved_cfg = saved

    def reconfigure(saved: dict, where: Path):
        return config.from_saved(saved, overrides, where=f"{where}: the saved config")

    cfg = reconfigure(saved_cfg, path)
    if args.config is not None:
        given = {item.split("=", 1)[0].strip() for item in args.set}
        file = {section: {k: v for k, v in table.items() if f"{section}.{k}" not in given}
                for section, table in config.read(args.config).items() if isinstance(table, dict)}
        saved_values = {s: {k: saved_cfg.get(s, {}).get(k) for k in t} for s, t in file.items()}
        differ = [f"{k} = {new!r} in the file (saved: {old!r})" for k, old, new in
                  config.changes(saved_values, file)]
        if differ:
            _note(f"note: {args.config} differs from the config saved in {path}: {', '.join(differ)}; a resumed "
                  "run keeps the saved values (--set changes one)")
    return cfg, path, reconfigure


def _check_origin(args) -> None:
    """``--from CHECKPOINT``: a new run, from a checkpoint file that exists."""
    if args.resume is not None:
        raise _usage("--from starts a new run from a checkpoint's weights; --resume continues a run: give one")
    if args.config is None:
        raise _usage("--from needs the CONFIG file of the new run")
    origin = Path(args.origin)
    if origin.is_dir():
        raise _usage(f"--from takes a checkpoint file, not the directory {origin} (its checkpoints: "
                     f"{origin / 'checkpoints'}/step-*.h5)")
    if not origin.is_file():
        raise _failure(f"--from {origin}: no such checkpoint file")


def _resume_dir(args) -> Path:
    """The run directory ``--resume`` continues: the one it names, ``--run-dir``, or the
    only run of CONFIG."""
    from mpitrain.train import resume

    named = None if args.resume is True else args.resume
    if named is not None and args.run_dir is not None and Path(named) != Path(args.run_dir):
        raise _usage(f"--resume {named} and --run-dir {args.run_dir} name different run directories")
    if named is not None and not Path(named).exists():  # a typo must not start a new run
        raise _failure(f"--resume {named}: no such run directory (to start a run there, or continue it if it "
                       f"exists, as a requeued job does: mpitrain train CONFIG --run-dir {named} --resume)")
    named = named or args.run_dir
    if named is not None:
        _not_the_checkpoints_folder(named, "--resume")
        if Path(named).is_file():
            raise _usage(f"--resume takes a run directory, not the file {named}: mpitrain train CONFIG --resume, "
                         "or mpitrain train --resume RUN_DIR")
        return Path(named)
    run_dir, line = resume.find_run(Path(args.config).stem)
    _note(line)
    return run_dir


def _not_the_checkpoints_folder(path, option: str) -> None:
    """A run's ``checkpoints/`` folder given where the run was meant: refused, with the run
    (a run started there would be a new one, at step 0, inside the other's checkpoints)."""
    from mpitrain.checkpoint import run_holding

    if (run := run_holding(path)) is not None:
        raise _usage(f"{option} {path} is the checkpoints folder of the run {run}: give the run directory, "
                     f"{option} {run}")


def _new_run_dir(stem: str) -> Path:
    """``runs/<config name>``; if a run already left checkpoints there, the next free
    ``runs/<config name>-<n>``."""
    from mpitrain.checkpoint import listed

    paths = (Path("runs") / (stem if n == 1 else f"{stem}-{n}") for n in itertools.count(1))
    return next(path for path in paths if not listed(path))


def _train_parser(commands) -> None:
    p = commands.add_parser("train", help="train a model described by a TOML config",
                            description="Train a model described by a TOML config (see jobs/), or resume a run.",
                            epilog="Ctrl-C, SIGTERM or SIGUSR1 finish the step, save a checkpoint and stop "
                                   "(exit 130 after Ctrl-C, 0 after the others). Under mpiexec a second Ctrl-C "
                                   "aborts at once, saving nothing: run through 'mpitrain launch mpiexec ...' to "
                                   "make a repeated Ctrl-C (or one under timeout) safe.")
    run_arguments(p)
    p.add_argument("--from", dest="origin", metavar="CHECKPOINT",
                   help="start a new run (step 0, a fresh optimizer) from the model weights of CHECKPOINT, a "
                        "file of any run (run.json records which)")
    p.add_argument("--start-over", action="store_true",
                   help="with --resume: if no checkpoint of the run can be used, start it again at step 0 "
                        "(unusable files are moved to checkpoints/unusable/, never deleted)")
    p.set_defaults(run=_train)


def run_arguments(p) -> None:
    """What names a run's config, for ``train`` and ``config show`` alike."""
    p.add_argument("config", nargs="?", help="path of the TOML config, e.g. jobs/mnist5k_lenet.toml (a resumed "
                                             "run takes its saved config: then optional)")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override one config value (TOML syntax), e.g. --set optim.lr=3e-4; repeatable; with "
                        "--resume, a change to the saved config, listed when the run starts")
    p.add_argument("--run-dir", metavar="DIR",
                   help="where checkpoints and metrics.jsonl go (run.dir; default runs/<config name>, "
                        "or runs/<config name>-<n> when an earlier run is there)")
    p.add_argument("--resume", nargs="?", const=True, metavar="RUN_DIR",
                   help="continue RUN_DIR (or --run-dir, or the only run of CONFIG in runs/) from its newest "
                        "usable checkpoint, with the config saved in it; a run directory without checkpoints "
                        "starts from CONFIG")


def config_show(args) -> None:
    """``mpitrain config show``: the config ``mpitrain train`` would run with the same
    arguments, as a TOML file, each value with where it came from: its default, the
    CONFIG file, ``--set``, ``--run-dir``, or the checkpoint a resumed run takes it from."""
    from mpitrain.comm import launcher_rank
    from mpitrain.config import RENAMED, annotated

    args.start_over, args.origin = False, None
    cfg, saved_in, _ = _train_config(args)
    if launcher_rank() not in (None, 0):  # under mpiexec: checked on every rank, printed once
        return
    origins = {key: f"{saved_in} (the resumed run's)" if saved_in else str(args.config) for key in cfg.given}
    for item in args.set:  # an old name set counts as the new one
        key = item.split("=", 1)[0].strip()
        origins[RENAMED.get(key, key)] = "--set"
    if args.resume is not None:
        origins["run.dir"] = "--resume" if args.resume is not True or args.run_dir is None else "--run-dir"
    elif args.run_dir is not None:
        origins["run.dir"] = "--run-dir"
    elif "run.dir" not in cfg.given:
        origins["run.dir"] = "default: runs/<config name>, or the first runs/<config name>-<n> that holds no run"
    line = " ".join(["mpitrain train", *([args.config] if args.config else []), *(f"--set {s}" for s in args.set),
                     *([f"--run-dir {args.run_dir}"] if args.run_dir else []),
                     *(["--resume" + ("" if args.resume is True else f" {args.resume}")] if args.resume else [])])
    header = "\n".join([f"The config that '{line}' runs: every field, each with where its value came from; a value "
                         "at its default is a comment, as in a file that leaves it out.", *cfg.notes])
    sys.stdout.write(annotated(cfg, origins, header))


def _trained_run_arguments(p) -> None:
    """What sample and eval take alike: the run (or checkpoint), and changes to its saved config."""
    p.add_argument("target", metavar="RUN_DIR|CHECKPOINT", help="a run directory, or a checkpoint file of one")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="change the saved config, e.g. --set data.path=... where the data is now (or another "
                        "dataset of the run's vocabulary: it replaces a saved data.name)")


def _sample_parser(commands) -> None:
    p = commands.add_parser("sample", help="draw text from a trained GPT run, and time it",
                            description="Load the newest checkpoint of RUN_DIR whose every byte verifies (or the "
                                        "CHECKPOINT file), saved by any layout, and print text drawn after each "
                                        "prompt, with a key-value cache: each new character one pass of one "
                                        "token. The tokenizer is the run's dataset's (its manifest's vocabulary). "
                                        "Its figures (time to first token, time per output token, tokens/s, "
                                        "the cache's bytes, the peak memory) go to stderr, or with the text to "
                                        "stdout as JSON (--json). Under mpiexec -n P: --tp T ranks hold one "
                                        "model sliced as tensor-parallel training slices it, and P/T such "
                                        "groups share the prompts. Ctrl-C ends it with what it has drawn.")
    _trained_run_arguments(p)
    p.add_argument("--prompt", help="the text to continue (default: the first character of the validation split)")
    p.add_argument("--prompt-file", metavar="FILE", help="a prompt a line (UTF-8): drawn after each, in one batch")
    p.add_argument("--batch", type=_positive, default=1, metavar="N",
                   help="draw N sequences after the prompt at once, each from its own stream (default 1)")
    p.add_argument("--tokens", type=_positive, default=500, help="characters to draw after each prompt (default 500)")
    p.add_argument("--temperature", type=_positive_float, default=0.8,
                   help="divides the logits: lower is more conservative (default 0.8)")
    p.add_argument("--top-k", type=_positive, help="draw among the K likeliest characters only (default: all)")
    p.add_argument("--seed", type=_non_negative, default=1337,
                   help="the sampling streams' seed, 0 or more: sequence i draws from stream (seed, i) (default 1337)")
    p.add_argument("--tp", type=_positive, default=1, metavar="T",
                   help="tensor-parallel ranks a model is sliced over (heads and MLP columns; default 1)")
    p.add_argument("--dp", type=_positive, metavar="D",
                   help="data-parallel groups sharing the prompts (default: the ranks / --tp)")
    p.add_argument("--no-cache", dest="cache", action="store_false",
                   help="recompute the whole window for each character (the plain way; slower, the same text)")
    p.add_argument("--json", action="store_true",
                   help="print the texts and the figures as one JSON object on stdout, unrounded")
    p.set_defaults(run=_sample)


def _sample(args) -> int:
    import numpy as np

    from mpitrain.comm import world
    from mpitrain.train import sampling, trained
    from mpitrain.train.signals import StopSignals

    comm = world()
    overrides = args.set + [f"train.global_batch_size={comm.size}"]  # drawing reads no batch: any rank count
    run, _, path = trained.load(args.target, comm, _quiet, overrides, warn=_note)
    try:
        prompts = trained.prompts_of(run, args.prompt, args.prompt_file, args.batch)
        progress = sampling.Progress() if args.tokens >= 1000 and not args.json else None
        with StopSignals(loud=comm.rank == 0, then="printing what is drawn so far") as signals:
            texts, figures = trained.serve(run, comm, prompts, args.tokens, temperature=args.temperature,
                                           top_k=args.top_k, seed=args.seed, tp=args.tp, dp=args.dp,
                                           cache=args.cache, stop=lambda: signals.received is not None,
                                           progress=progress)
        if progress is not None:
            progress.end()
    finally:
        run.close()
    if comm.rank == 0:
        if args.json:
            print(json.dumps({"checkpoint": str(path), "texts": texts, **figures},
                             default=lambda x: x.item() if isinstance(x, np.generic) else str(x)))
        else:
            for i, text in enumerate(texts):
                print(text if len(texts) == 1 else f"--- sequence {i + 1} of {len(texts)} ---\n{text}")
            sys.stdout.flush()
            print("\n".join([f"({path}, {comm.size} rank(s))", *sampling.report(figures)]), file=sys.stderr)
    return INTERRUPTED if figures["stopped"] else 0


def _eval_parser(commands) -> None:
    p = commands.add_parser("eval", help="score a trained run's checkpoint on a split",
                            description="Load the newest checkpoint of RUN_DIR whose every byte verifies (or the "
                                        "CHECKPOINT file), saved by any layout, and score it on a split as the "
                                        "run did: the same windows or images, the same train.eval_batches. On "
                                        "one process, or spread over the ranks of mpiexec -n P.")
    _trained_run_arguments(p)
    p.add_argument("--split", help="the split to score (default: the one the run scored: val for text, test for "
                                   "images)")
    p.add_argument("--batches", type=int, metavar="N",
                   help="text: score the first N global batches of windows (0: the whole split; default: the "
                        "run's train.eval_batches)")
    p.add_argument("--flip", action="store_true",
                   help="images: score each image and its mirror, averaging their probabilities (the same as "
                        "--set train.eval_flip=true; a run saved with it does so already, --set "
                        "train.eval_flip=false scores one view)")
    p.add_argument("--json", action="store_true", help="print the figures as one JSON line, unrounded")
    p.set_defaults(run=_eval)


def _eval(args) -> None:
    from mpitrain.comm import world
    from mpitrain.train import trained

    overrides = args.set + ([f"train.eval_batches={args.batches}"] if args.batches is not None else [])
    overrides += ["train.eval_flip=true"] if args.flip else []
    comm = world()
    run, step, path = trained.load(args.target, comm, _quiet, overrides, warn=_note)
    try:
        figures = trained.evaluate(run, step, comm, _quiet if args.json else _rank0_print(comm), args.split)
    finally:
        run.close()
    if comm.rank == 0:
        print(json.dumps({"checkpoint": str(path), **figures}) if args.json else f"({path}, {comm.size} rank(s))")


def _quiet(*args) -> None:
    pass


def _rank0_print(comm):
    return print if comm.rank == 0 else _quiet
