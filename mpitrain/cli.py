"""The ``mpitrain`` command line: each command's parser and the function that runs it
(``train``, ``sample`` and ``eval``: :mod:`mpitrain.cli_train`; ``bench``: :mod:`mpitrain.cli_bench`;
``data``: :mod:`mpitrain.cli_data`; ``plan``: :mod:`mpitrain.plan.cli`).

Commands that may run under ``mpiexec`` (``train``, ``bench io``) start MPI through
:func:`mpitrain.comm.world`. Errors about the input (config, data) are raised on every
rank together, printed once by rank 0 as one line, and exit with status 2; any other
exception on one rank prints its traceback and aborts every rank.
"""

from __future__ import annotations

import argparse
import os
import re
import select
import signal
import sys

from mpitrain import __version__
from mpitrain.cli_common import INTERRUPTED, _failure, _note, _positive, _prints_errors, _usage
from mpitrain.output import OutputError, file_option


def _report(args) -> None:
    from mpitrain.observe.report import ReportError, report

    try:
        report(args.run_dirs, out=args.out)
    except ReportError as e:
        raise _failure(str(e)) from None


def _cluster(args) -> int:
    from mpitrain.cluster import Cluster, ClusterError, counters_table, describe

    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        raise _usage("give the command to run after --, e.g. mpitrain cluster --nodes 2 -- mpitrain bench ddp")
    try:
        with Cluster(args.nodes, args.ranks, args.rate, args.mtu, args.netmod, args.delayed_acks,
                     args.dilation) as cluster:
            print(describe(cluster), flush=True)
            code = cluster.run(command)
            print(counters_table(cluster.counters()), flush=True)
            return code
    except ClusterError as e:
        raise _failure(str(e)) from None


def _config_reference(args) -> None:
    from mpitrain.config import reference
    from mpitrain.output import write_text

    if args.out:
        write_text(args.out, reference())
    else:
        sys.stdout.write(reference())


def _command_parser(parser, argv):
    """The parser of the (sub)command ``argv`` names, whose usage goes with its errors."""
    while (subcommands := getattr(parser, "subcommands", None)) is not None:
        named = [t for t in argv if t in subcommands.choices]
        if not named:
            break
        parser = subcommands.choices[named[0]]
        argv = argv[argv.index(named[0]) + 1:]
    return parser


# a launcher's options for the ranks to start (mpiexec's, torchrun's), given to mpitrain train by habit
RANK_OPTIONS = ("-n", "-np", "--np", "--nproc_per_node", "--nproc-per-node", "--ranks", "--world_size", "--world-size")


def _set_hint(args, unknown: list[str], argv: list[str] = ()) -> str:
    """For ``train``, the ``--set`` lines that do what unknown options such as ``--epochs
    2``, ``--lr=3e-4`` or ``--batch-size 32`` meant, as a clause of the error."""
    from mpitrain.config import field_for_option

    if getattr(args, "command", None) != "train":
        return ""
    for k, token in enumerate(argv):  # a launcher's option: the ranks are mpiexec's to start
        option, eq, value = token.partition("=")
        if option in RANK_OPTIONS:
            ranks = value or (argv[k + 1] if k + 1 < len(argv) and argv[k + 1].isdigit() else "N")
            return f"; mpitrain runs on the ranks its launcher starts: mpiexec -n {ranks} mpitrain train CONFIG"
    hints = []
    for i, token in enumerate(unknown):
        option, eq, value = token.partition("=")
        key = field_for_option(option) if option.startswith("--") else None
        if key is None:
            continue
        if not eq:
            following = unknown[i + 1] if i + 1 < len(unknown) else ""
            value = following if following and not following.startswith("--") else "VALUE"
        hints.append(f"--set {key}={value}")
    return f"; a config field is set with --set: {' '.join(hints)}" if hints else ""


class _Parser(argparse.ArgumentParser):
    """The argument parser, whose usage errors (the same on every rank) one rank prints.
    It keeps its subcommands' action (``subcommands``), whose parsers usage errors name."""

    def add_subparsers(self, **kwargs):
        self.subcommands = super().add_subparsers(**kwargs)  # the subparsers are _Parser too
        return self.subcommands

    def error(self, message):
        if _prints_errors():
            super().error(message)  # prints the usage and the message, exits with status 2
        self.exit(2)


def _dilation(text: str) -> float | str:
    if text == "auto":
        return text
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number or auto, got {text}") from None


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="mpitrain", description="Distributed deep-learning training on NumPy and MPI.",
                     epilog="Run 'mpitrain COMMAND --help' for a command's options.")
    parser.add_argument("--version", action="version", version=f"mpitrain {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    from mpitrain.cli_bench import add_parser as _bench_parser
    from mpitrain.cli_data import add_parser as _data_parser
    from mpitrain.cli_train import add_parsers as _train_parsers
    from mpitrain.plan.cli import add_parser as _plan_parser

    for add in (_train_parsers, _launch_parser, _plan_parser, _bench_parser, _report_parser, _data_parser,
                _cluster_parser, _config_parser):
        add(commands)
    return parser


def _launch_parser(commands) -> None:
    from mpitrain.launch import REPEAT_S

    p = commands.add_parser(
        "launch", help="run a launch line so that Ctrl-C, pressed once or more, or under timeout, ends in a checkpoint",
        description="Run LAUNCH_LINE (mpiexec ... mpitrain train ...) in a session of its own and pass on signals: "
                    f"the first SIGINT, then none within {REPEAT_S:g} s of it (a key pressed twice, or the copy "
                    "coreutils' timeout sends), then the next (mpiexec then aborts at once); SIGTERM, SIGUSR1 and "
                    "SIGQUIT, and SIGHUP as SIGTERM. MPICH's mpiexec kills every rank at a second SIGINT, before "
                    "they can save. Exits with the launch line's status (mpitrain/launch.py).",
        epilog="example: timeout 3600 mpitrain launch mpiexec -n 2 mpitrain train jobs/shakespeare_gpt.toml")
    p.add_argument("line", nargs=argparse.REMAINDER, metavar="LAUNCH_LINE", help="the command to run, e.g. mpiexec "
                                                                                  "-n 4 mpitrain train CONFIG")
    p.set_defaults(run=_launch)


def _launch(args) -> int:
    from mpitrain.launch import LaunchError, run

    line = args.line[1:] if args.line[:1] == ["--"] else args.line
    if not line:
        raise _usage("give the launch line to run, e.g. mpitrain launch mpiexec -n 2 mpitrain train CONFIG")
    try:
        return run(line)
    except LaunchError as e:
        raise _failure(str(e)) from None


def _report_parser(commands) -> None:
    p = commands.add_parser("report", help="plots and a summary of finished runs",
                            description="Draw PNG plots (loss, time per rank, throughput) and a text summary "
                                        "from each run directory's metrics.jsonl, into RUN_DIR/report/; with "
                                        "runs of one job at several rank counts, also scaling.png.")
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run directories of 'mpitrain train'")
    p.add_argument("--out", help="where to write (one run: instead of RUN_DIR/report; several: scaling.png, "
                                 "default next to the first run)")
    p.set_defaults(run=_report)


def _cluster_parser(commands) -> None:
    p = commands.add_parser(
        "cluster", help="run a command under mpiexec across emulated nodes and network links (root)",
        description="Emulate NODES nodes of RANKS ranks each on this machine (one network namespace per node, "
                    "veth links shaped with tc to RATE) and run COMMAND on every rank under MPICH's mpiexec; "
                    "print each link's bytes at the end, and always tear down. An emulation: no added "
                    "latency, and at high rates a small machine's TCP stack, not the link, is the limit "
                    "(mpitrain/cluster.py). Needs root and iproute2.",
        epilog="example: mpitrain cluster --nodes 2 --ranks 1 --rate 1gbit -- mpitrain bench ddp")
    p.add_argument("--nodes", type=_positive, default=2, help="emulated nodes (default 2)")
    p.add_argument("--ranks", type=_positive, default=1, help="MPI ranks per node (default 1)")
    p.add_argument("--rate", default="1gbit", help="bandwidth of each link, each way, as tc writes it "
                                                   "(default 1gbit; e.g. 100mbit, 10gbit)")
    p.add_argument("--mtu", type=int, default=1500, help="MTU of the links (default 1500)")
    p.add_argument("--netmod", choices=("ofi", "ucx"), default="ofi",
                   help="MPICH's network module over the links (default ofi, its tcp provider)")
    p.add_argument("--delayed-acks", action="store_true",
                   help="keep the kernel's delayed ACKs on the links (default off: with them long allreduces "
                        "stalled for the delayed-ACK timer, which a cluster's fabric does not do)")
    p.add_argument("--dilation", type=_dilation, default=1.0, metavar="D|auto",
                   help="time dilation: links at RATE/D and each node held to RANKS/D cores, so that more ranks "
                        "than cores emulate one core per rank; auto: ranks/cores when above 1 (default 1: none)")
    p.add_argument("command", nargs=argparse.REMAINDER, metavar="-- COMMAND", help="what every rank runs")
    p.set_defaults(run=_cluster)


def _config_parser(commands) -> None:
    config = commands.add_parser("config", help="the fields of a TOML config, and the config a run would take",
                                 description="The fields of a config's TOML tables (jobs/CONFIG.md), and the "
                                             "config a run would take from its file and options (show).")
    actions = config.add_subparsers(dest="action", required=True, metavar="ACTION")
    p = actions.add_parser("reference", help="print every field: type, default, meaning, what reads it",
                           description="Print the configuration reference in Markdown, generated from "
                                       "mpitrain/config/fields.py: every field, its type, default and meaning, "
                                       "and which models, optimizers and syncs read it (jobs/CONFIG.md is its "
                                       "output).")
    p.add_argument("--out", metavar="PATH", type=file_option,
                   help="write it to PATH (e.g. jobs/CONFIG.md) instead of printing it")
    p.set_defaults(run=_config_reference)
    from mpitrain.cli_train import config_show, run_arguments

    p = actions.add_parser("show", help="print the config a run would take, each value with where it came from",
                           description="Print the config that 'mpitrain train' with the same arguments would run "
                                       "(CONFIG, --set, --run-dir, --resume), checked as train checks it, as a TOML "
                                       "file: every field of every section, and after each value where it came "
                                       "from: default, the CONFIG file, --set, --run-dir, or the checkpoint a "
                                       "resumed run takes its saved config from. Nothing is run or written.",
                           epilog="example: mpitrain config show jobs/shakespeare_gpt.toml --set train.steps=10")
    run_arguments(p)
    p.set_defaults(run=config_show, command="config")


def main(argv=None) -> int:
    """The ``mpitrain`` command: its exit status. A reader of its output that goes away
    (``mpitrain plan ... | head``) ends it quietly with the status of a process that
    SIGPIPE ended, as for any Unix tool, not with a traceback; an output the caller closed
    (``>&-``) is the null device."""
    for name in ("stdout", "stderr"):  # closed by the caller (``>&-``): what would go there goes nowhere
        if getattr(sys, name) is None:
            setattr(sys, name, open(os.devnull, "w"))
    try:
        status = _main(argv)
        sys.stdout.flush()  # here rather than at exit, where a broken pipe could only be reported
        return status
    except BrokenPipeError:
        if not _stdout_gone():  # another pipe or socket (a download's, say): an error like any other
            raise
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # the exit's own flush must not fail again
        os.close(devnull)
        return 128 + signal.SIGPIPE


def _stdout_gone() -> bool:
    """Whether standard output is a pipe whose reader has gone (poll reports an error on it)."""
    try:
        poll = select.poll()
        poll.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & select.POLLERR for _, events in poll.poll(0))
    except (AttributeError, OSError, ValueError):  # no poll (Windows), or no real stdout
        return False


def _negative_values(argv: list[str]) -> list[str]:
    """``--memory-per-rank -5MB`` as ``--memory-per-rank=-5MB``: argparse takes a value that
    starts with a minus and a digit but is not a plain number for an option, and says only
    "expected one argument"; joined, the option's own check says what is wrong with it."""
    out = []
    for token in argv:
        if out and out[-1].startswith("--") and "=" not in out[-1] and re.fullmatch(r"-\d[\w.+-]*", token):
            out[-1] = f"{out[-1]}={token}"
        else:
            out.append(token)
    return out


def _main(argv) -> int:
    argv = _negative_values(sys.argv[1:] if argv is None else list(argv))
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # told with the command's own usage, and for train the --set that does it
        _command_parser(parser, argv).error(f"unrecognized arguments: {' '.join(unknown)}"
                                           f"{_set_hint(args, unknown, argv)}")
    from mpitrain.checkpoint import CheckpointError, CheckpointWriteError
    from mpitrain.comm import abort_on_exception, launcher_rank
    from mpitrain.config import ConfigError
    from mpitrain.data import DataError

    try:
        expected = (ConfigError, DataError, CheckpointError, FloatingPointError, OutputError, _usage, _failure)
        if getattr(args, "alone", None) and launcher_rank() is not None:
            command = " ".join(filter(None, (args.command, getattr(args, "bench", None))))
            raise _failure(f"{command} {args.alone}: run it without mpiexec")
        with abort_on_exception(expected=expected):
            return args.run(args) or 0  # a command's exit status; None: 0
    except _usage as e:
        _command_parser(parser, argv).error(str(e))
    except (CheckpointWriteError, OutputError) as e:  # not the input's fault: the disk's
        _note(f"mpitrain: error: {e}")
        return 1
    except (ConfigError, DataError, CheckpointError, _failure) as e:
        _note(f"mpitrain: error: {e}")
        return 2
    except FloatingPointError as e:
        _note(f"mpitrain: training diverged: {e}")
        return 1
    except KeyboardInterrupt:  # before the training loop's handlers (building, reading data), or another command
        _note("mpitrain: interrupted")
        return INTERRUPTED

