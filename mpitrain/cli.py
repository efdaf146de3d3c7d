"""The ``mpitrain`` command: ``mpitrain train CONFIG``, ``mpitrain bench step``."""

from __future__ import annotations

import argparse
import sys

from mpitrain import __version__


def _train(args) -> int:
    from mpitrain import config, train

    cfg = config.load(args.config, args.set)
    train.train(cfg)
    return 0


def _bench_step(args) -> int:
    from mpitrain.bench import step

    step.run(threads=args.threads, rounds=args.rounds, steps=args.steps)
    return 0


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mpitrain",
        description="Distributed deep-learning training on NumPy and MPI.",
        epilog="Run 'mpitrain COMMAND --help' for a command's options.",
    )
    parser.add_argument("--version", action="version", version=f"mpitrain {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = commands.add_parser("train", help="train a model described by a TOML config",
                            description="Train a model described by a TOML config (see jobs/).")
    p.add_argument("config", help="path of the TOML config, e.g. jobs/mnist5k_lenet.toml")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override one config value (TOML syntax), e.g. --set optim.lr=3e-4; repeatable")
    p.set_defaults(run=_train)

    bench = commands.add_parser("bench", help="measure speed (ratios taken side by side)",
                                description="Benchmarks that print ratios measured in one run.")
    benches = bench.add_subparsers(dest="bench", required=True, metavar="BENCH")
    p = benches.add_parser("step", help="training-step GFLOP/s of a GPT and a CNN vs. a large matmul",
                           description="Time training steps of the reference GPT and CNN beside a "
                                       "2048^3 float32 matmul and print their GFLOP/s ratios.")
    p.add_argument("--threads", type=_positive, default=1, help="BLAS threads (default 1)")
    p.add_argument("--rounds", type=_positive, default=7, help="interleaved measurement rounds (default 7)")
    p.add_argument("--steps", type=_positive, default=5, help="steps per model per round (default 5)")
    p.set_defaults(run=_bench_step)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    from mpitrain.config import ConfigError
    from mpitrain.data import DataError

    try:
        return args.run(args)
    except (ConfigError, DataError) as e:
        print(f"mpitrain: error: {e}", file=sys.stderr)
        return 2
    except FloatingPointError as e:
        print(f"mpitrain: training diverged: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("mpitrain: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
