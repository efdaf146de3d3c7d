"""``mpitrain bench``: each benchmark's parser and what checks its options before it runs
(registered by :mod:`mpitrain.cli`; the benchmarks: :mod:`mpitrain.bench`)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from mpitrain.cli_common import _failure, _non_negative, _positive, _usage
from mpitrain.output import file_option, write_text


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
        write_text(args.json, json.dumps(figures))  # {algorithm: {model: figures}}


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


def _bench_published() -> None:
    from mpitrain.plan import published

    published.run()


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


def add_parser(commands) -> None:
    bench = commands.add_parser("bench", help="measure speed (ratios taken side by side)",
                                description="Benchmarks that print ratios measured in one run.")
    benches = bench.add_subparsers(dest="bench", required=True, metavar="BENCH")
    _bench_planner_parsers(benches)
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
    p = benches.add_parser("sample", help="a token's step with the key-value cache vs. recomputing the window",
                           description="Draw tokens from a GPT of the shipped shape (jobs/shakespeare_gpt.toml) "
                                       "with the key-value cache and by recomputation, alternately, and print "
                                       "each one's median step at each context and batch, and their ratio.")
    p.add_argument("--contexts", type=_positive, nargs="+", default=[64, 256], help="contexts (default 64 256)")
    p.add_argument("--batches", type=_positive, nargs="+", default=[1, 8], help="sequences at once (default 1 8)")
    p.add_argument("--tokens", type=_positive, default=16, help="steps timed per row and round (default 16)")
    p.add_argument("--rounds", type=_positive, default=5, help="interleaved rounds (default 5)")
    p.add_argument("--threads", type=_positive, default=1, help="BLAS threads (default 1)")
    p.set_defaults(run=lambda a: _bench("sample", contexts=tuple(a.contexts), batches=tuple(a.batches),
                                        tokens=a.tokens, rounds=a.rounds, threads=a.threads), alone="times one process")
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


def _bench_planner_parsers(benches) -> None:
    p = benches.add_parser("plan", help="the planner against the run: mpitrain plan --validate for each layout, "
                                        "on shared memory and across emulated nodes",
                           description="Run 'mpitrain plan CONFIG --validate' for each layout (1 or 2 ranks) on "
                                       "shared memory, and with --network across 2 emulated nodes linked at each "
                                       "rate (root), and print tier 1's and the planner's step time against the "
                                       "measured, whether every counted quantity was exact, and the heap's errors. "
                                       "Run it without mpiexec.")
    p.add_argument("--config", default="jobs/shakespeare_gpt.toml", help="the config (default: %(default)s)")
    p.add_argument("--steps", type=_positive, default=20, help="timed steps per layout (default 20)")
    p.add_argument("--network", nargs="*", default=[], metavar="RATE",
                   help="also across 2 emulated nodes at these rates, e.g. 1gbit 10gbit (mpitrain cluster; root)")
    p.add_argument("--layouts", nargs="*", metavar="NAME", help="only these layouts (default: all)")
    p.add_argument("--catalogue", metavar="PATH",
                   help="predict with this calibration (mpitrain plan --calibrate --catalogue PATH) instead of "
                        "calibrating this machine and each rate's link first (under a minute)")
    p.set_defaults(run=_bench_plan, alone="starts its own ranks")
    p = benches.add_parser("search", help="the planner's search: tier 1's layouts a second against planning "
                                          "them one by one",
                           description="Rank every layout of GPT-3 on 1,024 A100s and of a 13B GPT on 64 by tier 1 "
                                       "(all at once) and plan a sample of them one by one (mpitrain.plan.make), "
                                       "and print layouts a second and their ratio.")
    p.add_argument("--repeats", type=_positive, default=3, help="runs of tier 1 per case, best kept (default 3)")
    p.add_argument("--sample", type=_positive, default=5, help="layouts planned one by one per case (default 5)")
    p.set_defaults(run=lambda a: _bench("search", repeats=a.repeats, sample=a.sample), alone="times one process")
    p = benches.add_parser("published", help="the planner against published large-model runs: step time and "
                                             "memory per GPU (mpitrain/plan/runs.toml)",
                           description="Plan each published run of mpitrain/plan/runs.toml as its paper laid it out "
                                       "and print the published and the predicted step time, the error, and the "
                                       "peak memory per GPU. Nothing is fitted to these runs.")
    p.set_defaults(run=lambda a: _bench_published(), alone="plans only")


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
    p.add_argument("--json", metavar="PATH", type=file_option, help="also write the figures to PATH as JSON (rank 0)")
    _thread_level_option(p)
    p.set_defaults(run=_bench_ddp)
