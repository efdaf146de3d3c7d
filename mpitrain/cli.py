"""The ``mpitrain`` command line: each command's parser and the function that runs it
(``train``, ``sample`` and ``eval``: :mod:`mpitrain.cli_train`; ``plan``: :mod:`mpitrain.plan.cli`).

Commands that may run under ``mpiexec`` (``train``, ``bench io``) start MPI through
:func:`mpitrain.comm.world`. Errors about the input (config, data) are raised on every
rank together, printed once by rank 0 as one line, and exit with status 2; any other
exception on one rank prints its traceback and aborts every rank.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from mpitrain import __version__

INTERRUPTED = 130  # the exit status after Ctrl-C (128 + SIGINT), as shells report it


def _note(message: str) -> None:
    """A line about the command or its error, printed once: by rank 0 (:func:`_prints_errors`)."""
    if _prints_errors():
        print(message, file=sys.stderr, flush=True)


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

    if args.out:
        Path(args.out).write_text(reference(), encoding="utf-8")
    else:
        sys.stdout.write(reference())


def _data_build(args) -> None:
    from mpitrain_datasets import RECIPES

    recipe = RECIPES[args.name]
    if recipe.needs_src and not args.src:
        raise _usage(f"data build {args.name}: --src is required ({recipe.src})")
    options = {"shard_mb": args.shard_mb, "chunk_kb": args.chunk_kb, "compression": args.compression}
    if args.val_fraction is not None:
        if not recipe.text:
            raise _usage(f"data build {args.name}: --val-fraction applies to text recipes only")
        options["val_fraction"] = args.val_fraction
    if args.unverified_source:
        if not recipe.idx:
            raise _usage(f"data build {args.name}: --unverified-source applies to IDX recipes only")
        options["unverified_source"] = True
    _built(args.out, lambda: recipe.build(args.src, args.out, **options))


def _data_download(args) -> None:
    from mpitrain_datasets import download

    out = args.out or download.default_out(args.name)
    src = download.fetch(args.name, cache=args.cache, mirror=args.mirror, out=out)
    _built(out, lambda: download.build(args.name, src, out))


def _built(out, build) -> None:
    """Run ``build`` (a recipe's, returning its DatasetWriter) and print what is in ``out`` now."""
    tick = time.perf_counter()
    writer = build()
    splits = ", ".join(f"{s} {v['count']:,} in {len(v['shards'])} shard(s)"
                       for s, v in writer.manifest["splits"].items())
    state = "already up to date" if writer.up_to_date else f"written in {time.perf_counter() - tick:.1f} s"
    print(f"{out}: {writer.name} ({writer.kind}): {splits}; {state}")


def _data_verify(args) -> int:
    from mpitrain.data import open_dataset

    data = open_dataset(args.path)
    if problems := data.verify():
        print(*(f"mpitrain: damaged: {p}" for p in problems), sep="\n", file=sys.stderr)
        return 1
    print(f"{args.path}: {data.name}: {sum(len(s.shards) for s in data.splits.values())} shards, "
          "structure and content SHA-256 match the manifest")
    return 0


def _data_info(args) -> None:
    from mpitrain.data import open_dataset

    data = open_dataset(args.path)
    m = data.manifest
    print(f"{data.path}: {data.name} ({data.kind}), format version {m['version']}, "
          f"compression {m['compression'] or 'none'}, written by {m.get('written_by', '?')} on {m.get('created', '?')}")
    for split in data.splits.values():
        size = sum(s.bytes for s in split.shards)
        print(f"  {split.name}: {split.count:,} x {list(split.sample_shape)} {split.x_dtype.name}, "
              f"{len(split.shards)} shard(s), {size / 1e6:.1f} MB, {split.chunk_rows} rows per chunk")
    if data.kind == "image":
        print(f"  classes: {', '.join(data.classes)}")
        print(f"  mean {list(data.mean)}, std {list(data.std)}")
    else:
        print(f"  vocabulary of {len(data.vocab)}: {data.vocab!r}")


def _bench(name: str, thread_level: str | None = None, **options) -> None:
    """``mpitrain bench NAME``: ``mpitrain.bench.NAME.run(**options)``, imported only now; given a
    ``thread_level``, under MPI started at that level, printing on rank 0 only."""
    import importlib

    if thread_level is not None:
        from mpitrain.comm import world

        options["log"] = print if world(thread_level).rank == 0 else lambda *a: None
    importlib.import_module(f"mpitrain.bench.{name}").run(**options)


def _bench_ddp(args) -> int | None:
    from mpitrain.bench import ddp

    if args.wire != "fp32" and "mpi" in (args.allreduce or ["mpi"]):
        raise _usage(f"--wire {args.wire} needs --allreduce ring: MPI cannot add 16-bit numbers in fp32")
    if args.wire != "fp32" and args.precision != "fp32":
        raise _usage(f"--wire is for float32 gradients; with --precision {args.precision} they are 16-bit already")
    if args.network is not None:
        return _bench_ddp_network(args)
    if args.mtu is not None:
        raise _usage("--mtu applies with --network")
    from mpitrain.comm import world

    comm = world(args.thread_level)
    figures = {algorithm: ddp.run(models=args.models or ["gpt", "wide"], rounds=args.rounds, steps=args.steps,
                                  bucket_mb=4.0 if args.bucket_mb is None else args.bucket_mb, algorithm=algorithm,
                                  wire=args.wire, precision=args.precision,
                                  warmup=ddp.WARMUP if args.warmup is None else args.warmup,
                                  log=print if comm.rank == 0 else lambda *a: None)
               for algorithm in args.allreduce or ["mpi"]}
    if args.json and comm.rank == 0:
        Path(args.json).write_text(json.dumps(figures), encoding="utf-8")  # {algorithm: {model: figures}}


def _bench_ddp_network(args) -> int:
    """``bench ddp --network RATE``: not under mpiexec; it starts its own ranks."""
    from mpitrain.bench import ddp
    from mpitrain.cluster import ClusterError, bits_per_second, check_tools, link_bucket_mb
    from mpitrain.comm import launcher_rank

    if launcher_rank() is not None:
        raise _usage("--network starts its own ranks (on shared memory, then across 2 emulated nodes): "
                     "run it without mpiexec")
    if bits_per_second(args.network) is None:
        raise _failure(f"--network {args.network!r}: expected a link rate such as 100mbit, 1gbit or 10gbit")
    if args.json:
        raise _usage("--json is for one run; --network prints both runs side by side")
    bucket_mb = link_bucket_mb(args.network) if args.bucket_mb is None else args.bucket_mb
    options = ["--models", *(args.models or ["gpt", "gpt-ddp"]), "--rounds", str(args.rounds), "--steps",
               str(args.steps), "--bucket-mb", f"{bucket_mb:.6g}", "--thread-level", args.thread_level,
               "--wire", args.wire, "--precision", args.precision]
    if args.warmup is not None:
        options += ["--warmup", str(args.warmup)]
    try:
        check_tools()
        return ddp.network(args.network, args.mtu or 1500, options, args.allreduce or ["mpi", "ring"])
    except ClusterError as e:
        raise _failure(f"--network: {e}") from None


class _usage(ValueError):
    """A command-line mistake found after parsing."""


class _failure(ValueError):
    """A problem with the input a command was given: one line, exit status 2."""


def _prints_errors() -> bool:
    """Whether this process prints the errors that every rank raises alike: rank 0 of
    the MPI world, or, before MPI has started (the config and the command line are read
    first), rank 0 by its launcher's environment, so that ``mpiexec -n 2`` prints one line."""
    from mpitrain.comm import launcher_rank, started_world

    world = started_world()
    return (launcher_rank() if world is None else world.rank) in (None, 0)


def _command_parser(parser, argv):
    """The parser of the (sub)command ``argv`` names, whose usage goes with its errors."""
    while subcommands := [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]:
        named = [t for t in argv if t in subcommands[0].choices]
        if not named:
            break
        parser = subcommands[0].choices[named[0]]
        argv = argv[argv.index(named[0]) + 1:]
    return parser


def _set_hint(args, unknown: list[str]) -> str:
    """For ``train``, the ``--set`` lines that do what unknown options such as ``--epochs
    2``, ``--lr=3e-4`` or ``--batch-size 32`` meant, as a clause of the error."""
    from mpitrain.config import field_for_option

    if getattr(args, "command", None) != "train":
        return ""
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
    """The argument parser, whose usage errors (the same on every rank) one rank prints."""

    def error(self, message):
        if _prints_errors():
            super().error(message)  # prints the usage and the message, exits with status 2
        self.exit(2)


def _bench_plan(args) -> int:
    from mpitrain.bench import plan
    from mpitrain.cluster import bits_per_second

    unknown = [n for n in args.layouts or () if n not in plan.LAYOUTS]
    if unknown:
        raise _usage(f"--layouts: no layout {unknown[0]!r} (there are: {'; '.join(plan.LAYOUTS)})")
    bad = [r for r in args.network if bits_per_second(r) is None]
    if bad:
        raise _usage(f"--network: {bad[0]!r} is not a rate such as 100mbit, 1gbit or 10gbit")
    if args.catalogue and not Path(args.catalogue).is_file():
        raise _usage(f"--catalogue: no file {args.catalogue}")
    return plan.run(args.config, args.steps, args.network, args.layouts or list(plan.LAYOUTS), args.catalogue)


def _bench_pipeline(args) -> None:
    odd = [m for m in args.micro_batches if args.batch % m]
    if odd:
        raise _usage(f"--batch {args.batch} does not split into {odd[0]} equal micro-batches")
    _bench("pipeline", rounds=args.rounds, ms=tuple(args.micro_batches), batch=args.batch)


def _bench_memory(args) -> None:
    from mpitrain.bench import memory

    memory.run(ranks=args.ranks, syncs=args.syncs, precisions=args.precisions, as_json=args.json)
    if not args.json:
        print()
        memory.activations()


def _thread_level_option(p: argparse.ArgumentParser) -> None:
    # the constant only: importing comm starts no MPI
    from mpitrain.comm import THREAD_LEVELS

    p.add_argument("--thread-level", default="auto", choices=THREAD_LEVELS,
                   help="MPI thread level (default auto, as parallel.thread_level)")


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r}: must be a finite number > 0")
    return value


def _dilation(text: str) -> float | str:
    if text == "auto":
        return text
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number or auto, got {text}") from None


def _non_negative(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be a non-negative integer, got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="mpitrain", description="Distributed deep-learning training on NumPy and MPI.",
                     epilog="Run 'mpitrain COMMAND --help' for a command's options.")
    parser.add_argument("--version", action="version", version=f"mpitrain {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    from mpitrain.cli_train import add_parsers as _train_parsers
    from mpitrain.plan.cli import add_parser as _plan_parser

    for add in (_train_parsers, _launch_parser, _plan_parser, _bench_parsers, _report_parser, _data_parsers,
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


def _bench_parsers(commands) -> None:
    bench = commands.add_parser("bench", help="measure speed (ratios taken side by side)",
                                description="Benchmarks that print ratios measured in one run.")
    benches = bench.add_subparsers(dest="bench", required=True, metavar="BENCH")
    p = benches.add_parser("plan", help="the planner against the run: mpitrain plan --validate for each layout, "
                                        "on shared memory and across emulated nodes",
                           description="Run 'mpitrain plan CONFIG --validate' for each layout (1 or 2 ranks) on "
                                       "shared memory, and with --network across 2 emulated nodes linked at each "
                                       "rate (root), and print predicted against measured step time, whether every "
                                       "counted quantity was exact, and the heap's errors. Run it without mpiexec.")
    p.add_argument("--config", default="jobs/shakespeare_gpt.toml", help="the config (default: %(default)s)")
    p.add_argument("--steps", type=_positive, default=20, help="timed steps per layout (default 20)")
    p.add_argument("--network", nargs="*", default=[], metavar="RATE",
                   help="also across 2 emulated nodes at these rates, e.g. 1gbit 10gbit (mpitrain cluster; root)")
    p.add_argument("--layouts", nargs="*", metavar="NAME", help="only these layouts (default: all)")
    p.add_argument("--catalogue", metavar="PATH",
                   help="predict with this calibration (mpitrain plan --calibrate --catalogue PATH) instead of "
                        "calibrating this machine and each rate's link first (under a minute)")
    p.set_defaults(run=_bench_plan, alone="starts its own ranks")
    p = benches.add_parser("step", help="training-step GFLOP/s of a GPT and a CNN vs. a large matmul",
                           description="Time training steps of the reference GPT and CNN beside a "
                                       "2048^3 float32 matmul and print their GFLOP/s ratios.")
    p.add_argument("--threads", type=_positive, default=1, help="BLAS threads (default 1)")
    p.add_argument("--rounds", type=_positive, default=7, help="interleaved measurement rounds (default 7)")
    p.add_argument("--steps", type=_positive, default=5, help="steps per model per round (default 5)")
    p.add_argument("--no-torch", action="store_true",
                   help="leave out PyTorch's equivalent steps, which run when PyTorch is importable")
    p.set_defaults(run=lambda a: _bench("step", threads=a.threads, rounds=a.rounds, steps=a.steps,
                                        torch=not a.no_torch), alone="times one process")
    p = benches.add_parser("memory", help="model state per rank of ddp (fp32, bf16, fp16) and ZeRO stages 1-3 vs. "
                                          "the formulas (not under mpiexec: it starts its own ranks)",
                           description="Train the reference GPT for three steps with each gradient sync on "
                                       "each number of ranks, tracing the heap, and print the model state "
                                       "each rank holds, measured, counted and by ZeRO's formula.")
    p.add_argument("--ranks", type=_positive, nargs="+", default=[1, 2, 4], help="values of P (default 1 2 4)")
    p.add_argument("--syncs", nargs="+", default=["ddp", "zero1", "zero2", "zero3"],
                   choices=["ddp", "zero1", "zero2", "zero3"], help="the gradient syncs (default: all four)")
    p.add_argument("--precisions", nargs="+", default=["fp32", "bf16", "fp16"], choices=["fp32", "bf16", "fp16"],
                   help="ddp's number formats (default: all three; bf16 and fp16 are mixed precision); the ZeRO "
                        "stages run in fp32")
    p.add_argument("--json", action="store_true", help="print every rank's figures as JSON instead")
    p.set_defaults(run=_bench_memory, alone="starts its own ranks")
    p = benches.add_parser("io", help="shard reader vs. raw sequential read (run under mpiexec -n 2)",
                           description="Read a shard set's training split through the reader with 1 and 2 "
                                       "ranks, uncompressed and gzip, from the page cache and from the "
                                       "device, beside a raw sequential read of the same files.")
    p.add_argument("path", help="a dataset directory (from 'mpitrain data build')")
    p.add_argument("--batch", type=_positive, default=256, help="global batch size (default 256)")
    p.add_argument("--repeats", type=_positive, default=5, help="measurements per row, best kept (default 5)")
    p.add_argument("--buffer-mb", type=float, default=64,
                   help="reader round size over all ranks, as data.buffer_mb (default 64)")
    p.set_defaults(run=lambda a: _bench("io", thread_level="auto", path=a.path, batch=a.batch, repeats=a.repeats,
                                        buffer_mb=a.buffer_mb))
    _bench_parallel_parsers(benches)


def _bench_parallel_parsers(benches) -> None:
    p = benches.add_parser("allreduce", help="ring vs. MPI allreduce bandwidth (run under mpiexec -n 2 or 4)",
                           description="Time mpitrain's ring allreduce and MPI_Allreduce from 4 KiB to 64 MiB "
                                       "with 2 (and 4) ranks, beside the bound of the ring's data movement.")
    p.add_argument("--repeats", type=_positive, default=5, help="timings per size, median kept (default 5)")
    _thread_level_option(p)
    p.set_defaults(run=lambda a: _bench("allreduce", thread_level=a.thread_level, repeats=a.repeats))

    _bench_ddp_parser(benches)

    p = benches.add_parser("ps", help="parameter server with a straggler: sync vs. bounded vs. async "
                                      "(run under mpiexec -n 4)",
                           description="1 server + 3 workers, one of them three times as slow: time to apply the same "
                                       "number of gradients synchronously, with staleness bound 2, and asynchronously.")
    p.add_argument("--steps", type=_positive, default=40, help="gradients per worker, on average (default 40)")
    p.add_argument("--rounds", type=_positive, default=3, help="interleaved rounds (default 3)")
    p.set_defaults(run=lambda a: _bench("ps", thread_level="auto", steps=a.steps, rounds=a.rounds))

    p = benches.add_parser("pipeline", help="pipeline schedules: step, bubble vs. the formula, activation memory "
                                            "(run under mpiexec -n 2)",
                           description="Cut a stack of identical GPT blocks into one stage per rank and run "
                                       "GPipe, 1F1B, interleaved 1F1B (2 chunks per rank) and ZB-H1 at each "
                                       "number of micro-batches; print the step time, the measured bubble "
                                       "against the formula's, and the activation memory each stage holds.")
    p.add_argument("--rounds", type=_positive, default=5, help="interleaved rounds (default 5)")
    p.add_argument("--micro-batches", type=_positive, nargs="+", default=[2, 4, 8], help="values of m (default 2 4 8)")
    p.add_argument("--batch", type=_positive, default=64, help="global batch (default 64)")
    p.set_defaults(run=_bench_pipeline)

    p = benches.add_parser("tensor", help="transformer blocks sliced over the ranks vs. one rank: step, "
                                          "allreduce time and bytes per block vs. the formula, activation memory "
                                          "(run under mpiexec -n 2)",
                           description="Time the forward and backward of GPT blocks on one rank and sliced over "
                                       "all ranks (Megatron's tensor parallelism); print the speed-up, the "
                                       "allreduces' seconds and bytes per block against 8 (P-1)/P B T C itemsize, "
                                       "and the activations each rank holds.")
    p.add_argument("--rounds", type=_positive, default=5, help="interleaved rounds (default 5)")
    p.add_argument("--batch", type=_positive, default=8, help="batch (default 8)")
    p.set_defaults(run=lambda a: _bench("tensor", rounds=a.rounds, batch=a.batch))


def _bench_ddp_parser(benches) -> None:
    p = benches.add_parser("ddp", help="data-parallel step: 1 vs. 2 ranks, communication on/off, overlap "
                                       "(run under mpiexec -n 2, or alone with --network RATE)",
                           description="Time a GPT training step on 1 rank and on 2 ranks with and without "
                                       "the gradient allreduce, for each way of progressing it, and the "
                                       "allreduce alone; print speed-up and hidden communication.")
    p.add_argument("--models", nargs="+", choices=("gpt", "gpt-ddp", "wide"),
                   help="gpt: nanoGPT's small CPU GPT (global batch 12); gpt-ddp: the same at nanoGPT's batch "
                        "per process (12 per rank); wide: width 384, 32 tokens per rank (default gpt and wide; "
                        "with --network gpt and gpt-ddp)")
    p.add_argument("--rounds", type=_positive, default=5, help="interleaved rounds (default 5)")
    p.add_argument("--steps", type=_positive, default=5, help="timed steps per variant per round (default 5)")
    p.add_argument("--warmup", type=_non_negative,
                   help="untimed steps per variant at the start of each round (default 3)")
    p.add_argument("--bucket-mb", type=float, help="bucket size, as parallel.bucket_mb (default 4; with --network "
                                                    "2 ms of the link: 0.24 at 1gbit)")
    p.add_argument("--allreduce", nargs="+", choices=("mpi", "ring"),
                   help="algorithm(s), each timed in turn (default mpi; with --network mpi and ring)")
    p.add_argument("--network", metavar="RATE",
                   help="run the bench twice, on shared memory and across 2 emulated nodes linked at RATE (e.g. 1gbit; "
                        "see mpitrain cluster: needs root), and print them side by side; run it without mpiexec")
    p.add_argument("--mtu", type=int, help="with --network: the links' MTU (default 1500)")
    p.add_argument("--wire", default="fp32", choices=("fp32", "bf16", "fp16"),
                   help="the gradients' numbers on the wire, as parallel.wire (16-bit: with the ring only)")
    p.add_argument("--precision", default="fp32", choices=("fp32", "bf16", "fp16"),
                   help="as train.precision: bf16 and fp16 train in mixed precision, with 16-bit weights, "
                        "gradients and buckets (default fp32)")
    p.add_argument("--json", metavar="PATH", help="also write the figures to PATH as JSON (rank 0)")
    _thread_level_option(p)
    p.set_defaults(run=_bench_ddp)


def _report_parser(commands) -> None:
    p = commands.add_parser("report", help="plots and a summary of finished runs",
                            description="Draw PNG plots (loss, time per rank, throughput) and a text summary "
                                        "from each run directory's metrics.jsonl, into RUN_DIR/report/; with "
                                        "runs of one job at several rank counts, also scaling.png.")
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run directories of 'mpitrain train'")
    p.add_argument("--out", help="where to write (one run: instead of RUN_DIR/report; several: scaling.png, "
                                 "default next to the first run)")
    p.set_defaults(run=_report)


def _data_parsers(commands) -> None:
    from mpitrain_datasets import RECIPES

    data = commands.add_parser("data", help="download, build, check and describe shard datasets",
                               description="HDF5 shard datasets (format: datasets/README.md).")
    actions = data.add_subparsers(dest="action", required=True, metavar="ACTION")
    recipes = "\n".join(f"  {name:22} --src: {r.src}" for name, r in RECIPES.items())
    p = actions.add_parser("build", help="turn standard dataset files into shards",
                           formatter_class=argparse.RawDescriptionHelpFormatter,
                           description="Read a dataset in its standard format, verify it, and write a "
                                       "shard directory atomically.\n\nrecipes:\n" + recipes)
    p.add_argument("name", choices=sorted(RECIPES), metavar="NAME", help="the recipe (listed above)")
    p.add_argument("--src", help="the source files (see the recipe)")
    p.add_argument("--out", required=True, help="the dataset directory to write")
    p.add_argument("--shard-mb", type=float, default=16, help="megabytes per shard file (default 16)")
    p.add_argument("--chunk-kb", type=float, default=1024, help="HDF5 chunk size in KiB (default 1024)")
    p.add_argument("--compression", choices=("gzip", "lzf"), default=None,
                   help="compress chunks (default none: see 'mpitrain bench io' for the cost)")
    p.add_argument("--val-fraction", type=float, default=None,
                   help="text: the held-out share at the end of the text (default 0.1)")
    p.add_argument("--unverified-source", action="store_true",
                   help="IDX: accept files whose SHA-256 is not the published one")
    p.set_defaults(run=_data_build)
    _download_parser(actions)
    p = actions.add_parser("verify", help="re-hash every shard against the manifest",
                           description="Check the structure of every shard and re-hash its content.")
    p.add_argument("path", help="a dataset directory")
    p.set_defaults(run=_data_verify)
    p = actions.add_parser("info", help="describe a dataset directory",
                           description="Print a dataset's splits, shards, sizes and metadata.")
    p.add_argument("path", help="a dataset directory")
    p.set_defaults(run=_data_info)


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
    config = commands.add_parser("config", help="the configuration reference: every field of a TOML config",
                                 description="The fields of a config's TOML tables (jobs/CONFIG.md).")
    actions = config.add_subparsers(dest="action", required=True, metavar="ACTION")
    p = actions.add_parser("reference", help="print every field: type, default, meaning, what reads it",
                           description="Print the configuration reference in Markdown, generated from "
                                       "mpitrain/config/fields.py: every field, its type, default and meaning, and which "
                                       "models, optimizers and syncs read it (jobs/CONFIG.md is its output).")
    p.add_argument("--out", metavar="PATH", help="write it to PATH (e.g. jobs/CONFIG.md) instead of printing it")
    p.set_defaults(run=_config_reference)


def _download_parser(actions) -> None:
    from mpitrain_datasets.download import DOWNLOADS, MIRROR_ENV

    p = actions.add_parser(
        "download", help="download a dataset's canonical files, verify them, build shards",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Download the canonical files of NAME, check their published hashes, keep them in a "
                    "cache, and build\nshards with the recipe 'mpitrain data build' uses. An interrupted "
                    "download continues where it\nstopped; nothing unverified is kept (details: "
                    "datasets/download.py).\n\ndatasets:\n"
                    + "\n".join(f"  {n:16} {s.about}" for n, s in DOWNLOADS.items())
                    + "\n\nOffline, get the files by hand and build them with 'mpitrain data build' (a "
                      "failed download prints\nthe command). Fashion-MNIST also comes with Debian: apt-get "
                      "install dataset-fashion-mnist, then\nmpitrain data build fashion-mnist-debian --out "
                      "runs/data/fashion-mnist.")
    p.add_argument("name", choices=list(DOWNLOADS), metavar="NAME", help="the dataset (listed above)")
    p.add_argument("--out", help="the dataset directory to write (default runs/data/NAME, where the configs "
                                 "in jobs/ look)")
    p.add_argument("--cache", help="where downloaded files are kept, as CACHE/NAME/FILE (default downloads/ in "
                                   "$MPITRAIN_DATA, else in $XDG_CACHE_HOME/mpitrain or ~/.cache/mpitrain)")
    p.add_argument("--mirror", metavar="URL",
                   help=f"fetch from URL/NAME/FILE only, not the canonical hosts (default ${MIRROR_ENV}, "
                        "if set); e.g. a cache directory served over HTTP")
    p.set_defaults(run=_data_download)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # told with the command's own usage, and for train the --set that does it
        _command_parser(parser, argv).error(f"unrecognized arguments: {' '.join(unknown)}{_set_hint(args, unknown)}")
    from mpitrain.checkpoint import CheckpointError, CheckpointWriteError
    from mpitrain.comm import abort_on_exception, launcher_rank
    from mpitrain.config import ConfigError
    from mpitrain.data import DataError

    try:
        expected = (ConfigError, DataError, CheckpointError, FloatingPointError, _usage, _failure)
        if getattr(args, "alone", None) and launcher_rank() is not None:
            command = " ".join(filter(None, (args.command, getattr(args, "bench", None))))
            raise _failure(f"{command} {args.alone}: run it without mpiexec")
        with abort_on_exception(expected=expected):
            return args.run(args) or 0  # a command's exit status; None: 0
    except _usage as e:
        _command_parser(parser, argv).error(str(e))
    except CheckpointWriteError as e:  # not the input's fault: the disk's
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


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
