"""``mpitrain plan``: its parser and what it runs (registered by :mod:`mpitrain.cli`)."""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from mpitrain.cli_common import DOES_NOT_FIT
from mpitrain.output import file_option, unwritable

UNITS = {"": 1, "b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12, "kib": 2**10, "mib": 2**20, "gib": 2**30,
         "tib": 2**40}


def nbytes(text: str) -> float:
    """``16GB``, ``16 GiB``, ``1.5e10``: bytes."""
    m = re.fullmatch(r"\s*([0-9.]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in UNITS:
        raise argparse.ArgumentTypeError(f"expected bytes such as 16GB, 512MiB or 2e9, got {text!r}")
    try:
        value = float(m.group(1)) * UNITS[m.group(2).lower()]
    except ValueError:  # "1.2.3"
        raise argparse.ArgumentTypeError(f"expected bytes such as 16GB, 512MiB or 2e9, got {text!r}") from None
    if not value:
        raise argparse.ArgumentTypeError(f"expected bytes more than none, such as 16GB, got {text!r}")
    return value


def _cluster(text: str) -> tuple[int, int, str]:
    """``2x2@1gbit``: (nodes, ranks per node, tc rate)."""
    from mpitrain.cluster import bits_per_second

    m = re.fullmatch(r"(\d+)x(\d+)@(\S+)", text)
    if not m or int(m.group(1)) < 2 or int(m.group(2)) < 1 or bits_per_second(m.group(3)) is None:
        raise argparse.ArgumentTypeError(f"expected NODESxRANKS@RATE with 2 nodes or more, e.g. 2x2@1gbit; "
                                         f"got {text!r}")
    return int(m.group(1)), int(m.group(2)), m.group(3)


def _token_counts(text: str) -> list[float]:
    """``300e9,1e12``: token counts."""
    try:
        counts = [float(x) for x in text.split(",")]
    except ValueError:
        counts = []
    if not counts or not all(0 < x < float("inf") for x in counts):
        raise argparse.ArgumentTypeError(f"expected token counts such as 300e9 or 300e9,1e12, got {text!r}")
    return counts


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a share in (0, 1] such as 0.45, got {text}") from None
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be a share in (0, 1] such as 0.45, got {text}")
    return value


def _replaced(text: str) -> float:
    """``--utilization``, which scaled a GPU's products alone: replaced by ``--mfu``."""
    raise argparse.ArgumentTypeError("replaced: a GPU's products are now timed kernel by kernel "
                                     "(mpitrain/plan/gpu.py); --mfu SHARE sets the whole step's model FLOPs "
                                     "utilization instead, the planner's own step printed beside it")


def add_parser(commands) -> None:
    from mpitrain.cli_common import _positive  # the command line's own check

    p = commands.add_parser(
        "plan", help="predict what a run needs (memory, bytes, FLOPs, bubble, time) before it starts",
        description="Predict, from shapes alone (no model is built), what CONFIG needs on -n ranks: per rank the "
                    "model state, activations, bytes per communicator, FLOPs and the bubble; the step time and "
                    "its parts on this machine or a GPU cluster (--hardware); the storage bandwidth; whether it "
                    "fits. --validate runs it and prints estimate | exact | measured | error.",
        epilog="examples:\n  mpitrain plan jobs/shakespeare_gpt.toml -n 4 --set parallel.pp=2 --set parallel.tp=2 "
               "--set train.micro_batches=4\n  mpitrain plan --model gpt3-175b --hardware a100-80g --gpus-per-node 8 "
               "--nodes 128 --network ib-hdr --set train.global_batch_size=2048 --set parallel.sync=zero3\n"
               "  mpitrain plan --calibrate\n"
               "  mpiexec -n 2 mpitrain plan jobs/shakespeare_gpt.toml --validate\n"
               "exit status: 0, the plan (it fits); 3, it does not fit (--search: no layout fits; --largest: not "
               "even the smallest); 2, bad input\n"
               "the guide: mpitrain/plan/README.md",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config", nargs="?", help="the TOML config to plan (or --model)")
    p.add_argument("--model", metavar="NAME", help="a reference model of mpitrain/plan/models.toml instead of a "
                                                   f"config's ({', '.join(_shipped_models())}), or of your own "
                                                   "models file ($MPITRAIN_MODELS, ~/.config/mpitrain/models.toml)")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override one config value, as for mpitrain train; repeatable")
    p.add_argument("-n", "--ranks", type=_positive, help="ranks of the job (default: --nodes x --gpus-per-node, else 1;"
                                                      " under mpiexec with --validate: the job's)")
    _machine_arguments(p, _positive)
    p.add_argument("--memory-table", action="store_true",
                   help="also the memory per rank under each sync, with and without activation checkpointing "
                        "(always with --hardware)")
    p.add_argument("--largest", nargs="?", const="both", choices=("both", "width", "depth"),
                   help="print the largest model of CONFIG's (or --model's) family that fits every rank's memory "
                        "on this layout: grown in width and depth as the family grows (default), or in one")
    p.add_argument("--train-tokens", type=_token_counts, metavar="N[,N...]",
                   help="with --largest: also the time to train it on each of these token counts (e.g. 300e9,1e12)")
    p.add_argument("--tiers", action="store_true",
                   help="also tier 1's answer (the textbook's formulas) per rank beside tier 2's (exact for this "
                        "machine), with each named correction between them: activations, compute, the step")
    p.add_argument("--notes", action="store_true",
                   help="reproduce the course notes' arithmetic: a ResNet run's FLOPs and machine time, the storage "
                        "bandwidth of the calculator's models on V100, A100 and H100")
    p.add_argument("--calibrate", action="store_true",
                   help="measure this machine (GEMMs, memory streaming, links) into the user's catalogue (or "
                        "--catalogue PATH); refused while other processes use the cores")
    p.add_argument("--busy-ok", action="store_true",
                   help="with --calibrate: write it even if other processes use the cores (a warning instead)")
    _inference_arguments(p, _positive)
    p.add_argument("--validate", action="store_true",
                   help="run CONFIG for a few steps (under mpiexec: on its ranks) and print estimate (the textbook "
                        "tier, where it answers) | exact | measured | error for every quantity")
    _search_arguments(p, _positive)
    p.add_argument("--json", metavar="PATH", type=file_option,
                   help="with --validate: also write the rows to PATH (JSON)")
    p.add_argument("--html", metavar="FILE", type=file_option,
                   help="also write the plan as one self-contained HTML page (its figures inline; with --search the "
                        "layouts' time against memory, with --validate predicted against measured)")
    p.add_argument("--steps", type=_positive,
                   help="with --validate or --measure: steps of the timed run (default 20, in windows of 5; the first "
                        "is not timed)")
    p.set_defaults(run=run)


class Given(argparse.Action):
    """Store an option's value and note that it was given (``args.given``): an option of one
    mode given in another is refused, though its default is there in every mode."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, values)
        namespace.given = getattr(namespace, "given", set()) | {self.dest}


def _inference_arguments(p, positive) -> None:
    from mpitrain.plan.inference import duration

    g = p.add_argument_group("inference (--inference: drawing tokens, not training; CONFIG may be a run directory)")
    g.add_argument("--inference", action="store_true",
                   help="plan drawing tokens from the GPT: per rank its weights, KV cache and work arrays, the "
                        "prefill's and a decode step's FLOPs and time, time to first token and per output token, "
                        "tokens/s, the largest batch that fits (--validate: against mpitrain sample's figures)")
    g.add_argument("--batch", type=positive, default=1, action=Given, metavar="B",
                   help="sequences drawn at once (default 1)")
    g.add_argument("--prompt", dest="prompt_tokens", type=positive, default=1, action=Given, metavar="P",
                   help="tokens of each prompt (default 1)")
    g.add_argument("--tokens", type=positive, default=256, action=Given, metavar="N",
                   help="new tokens a sequence (default 256)")
    g.add_argument("--tp", type=positive, default=1, action=Given, metavar="T",
                   help="tensor-parallel ranks holding one model (default 1)")
    g.add_argument("--ttft-target", type=duration, metavar="TIME",
                   help="serving: the most requests at once whose time to first token is at most TIME (in s, or "
                        "with ms or us)")
    g.add_argument("--tpot-target", type=duration, metavar="TIME",
                   help="serving: ... whose time per output token is at most TIME")


def _shipped_models() -> list[str]:
    """The names of the shipped reference models (``models.toml``'s ``[gpt.NAME]`` tables), for the help: read
    as text, beside this file (mpitrain.plan.models.SHIPPED), not through the planner, which every command's help
    would then import."""
    text = Path(__file__).with_name("models.toml").read_text(encoding="utf-8")
    return re.findall(r"^\[gpt\.([^\]]+)\]", text, flags=re.M)


def _machine_arguments(p, positive) -> None:
    """The machine the job runs on (:func:`mpitrain.plan.machine_of` reads them): its device,
    nodes and links, a step's MFU to set, the memory each rank may use, the catalogue."""
    p.add_argument("--hardware", default="this", metavar="KEY",
                   help="the device of mpitrain/plan/hardware.toml each rank runs on (default 'this': this "
                        "machine, as calibrated); v100, a100-40g, a100-80g, a100-40g-pcie, a100-80g-pcie, h100, "
                        "h100-nvl, h200, mi250x (one GCD); or one of your own catalogue's (--catalogue)")
    p.add_argument("--nodes", type=positive, help="nodes of the job (default 1)")
    p.add_argument("--gpus-per-node", "--ranks-per-node", dest="per_node", type=positive, metavar="N",
                   help="ranks per node (default: all on one node)")
    p.add_argument("--network", metavar="KEY", help="the link between nodes (e.g. ib-hdr, ib-ndr, eth-100g; emu-1g "
                                                    "and emu-10g: the links of mpitrain cluster)")
    p.add_argument("--intra", metavar="KEY", help="the link inside a node (default: its device's in the catalogue, "
                                                  "intra and pair; shared memory here)")
    p.add_argument("--utilization", type=_replaced, help=argparse.SUPPRESS)  # replaced by --mfu: says so
    p.add_argument("--mfu", type=_fraction, metavar="SHARE",
                   help="set the step so that the model's FLOPs reach this share of the device's peak (MFU, "
                        "end to end: every part of the step scaled alike), the planner's own step printed beside")
    p.add_argument("--memory-per-rank", type=nbytes, metavar="BYTES",
                   help="memory each rank may use (default: the device's; here, this machine's over its ranks)")
    p.add_argument("--catalogue", metavar="PATH", help="a hardware catalogue to overlay the shipped one (default "
                                                       "$MPITRAIN_HARDWARE or ~/.config/mpitrain/hardware.toml)")


def _search_arguments(p, positive) -> None:
    """--search and what goes with it (:mod:`mpitrain.plan.search`, :mod:`mpitrain.plan.trial`)."""
    p.add_argument("--search", action="store_true",
                   help="plan every layout of CONFIG on -n ranks the trainer accepts (grid, sync, schedule, "
                        "micro-batches, precision, checkpointing, buckets), drop those that do not fit "
                        "--memory-per-rank, and print the fastest ten with the --set line that runs each")
    p.add_argument("--top", type=positive, default=10, action=Given, help="with --search: layouts shown (default 10)")
    p.add_argument("--cluster", type=_cluster, metavar="NODESxRANKS@RATE",
                   help="with --search: plan for (and --measure across) emulated nodes of mpitrain cluster, "
                        "e.g. 2x2@1gbit (their link as calibrated: emu-1g)")
    p.add_argument("--measure", type=positive, metavar="K",
                   help="with --search: run the top K and K other layouts that fit for a few steps (--steps), "
                        "print predicted | measured | rank and Spearman's correlation, and write them with a "
                        "plot to --out")
    p.add_argument("--repeat", type=positive, default=1, action=Given, metavar="N",
                   help="with --measure: launch each layout N times and keep its fastest run (default 1)")
    p.add_argument("--out", metavar="DIR", default="runs/search", action=Given,
                   help="with --measure: where the table (CSV, JSON) and the plot go (default %(default)s)")




def _refuse_combinations(args) -> None:
    """One line for an option that does nothing with the others given, or an output that
    cannot be written, before any work (ConfigError)."""
    from mpitrain.config import ConfigError
    from mpitrain.plan.hardware import user_path

    search = "goes with --search (mpitrain plan CONFIG -n P --search ...)"
    given = getattr(args, "given", set())
    alone = [("--steps", args.steps is not None and not (args.validate or args.measure),
              "the steps of a run --validate or --measure makes; a plan alone runs nothing"),
             ("--ttft-target", args.ttft_target and not args.inference, "goes with --inference"),
             ("--tpot-target", args.tpot_target and not args.inference, "goes with --inference"),
             ("--measure", args.measure and not args.search, search),
             ("--cluster", args.cluster and not args.search, search),
             ("--busy-ok", args.busy_ok and not args.calibrate, "goes with --calibrate"),
             ("--html", args.html and (args.calibrate or args.notes),
              "writes a plan, a search or a validation, not --calibrate or --notes"),
             ("--mfu", args.mfu and (args.search or args.validate or args.largest or args.calibrate),
              "sets one plan's step; leave it out of --search, --validate, --largest and --calibrate"),
             ("--train-tokens", args.train_tokens and not args.largest, "goes with --largest"),
             ("--largest", args.largest and (args.search or args.validate),
              "plans the grown model on the layout given; leave out --search and --validate"),
             ("--json", args.json and not args.validate, "writes --validate's rows; goes with --validate"),
             ("--top", "top" in given and not args.search, search),
             ("--repeat", "repeat" in given and not args.measure, "goes with --measure"),
             ("--out", "out" in given and not args.measure, "goes with --measure"),
             *((f"--{name}", dest in given and not args.inference, "goes with --inference")
               for name, dest in (("batch", "batch"), ("prompt", "prompt_tokens"), ("tokens", "tokens"), ("tp", "tp"))),
             ("--cluster", args.cluster and args.hardware != "this",
              "plans emulated nodes of this machine (its links as calibrated); leave out --hardware"),
             ("--calibrate", args.calibrate and (args.config or args.model or args.set or args.hardware != "this"
                                                 or args.ranks or args.nodes or args.per_node or args.network
                                                 or args.intra or args.memory_per_rank or args.search or args.validate
                                                 or args.largest or args.inference or args.notes or args.tiers
                                                 or args.memory_table),
              "measures this machine alone; give it with --catalogue and --busy-ok only"),
             ("--notes", args.notes and (args.search or args.validate or args.largest or args.inference),
              "prints the notes' arithmetic; leave out --search, --validate, --largest and --inference"),
             *((option, on and (args.search or args.validate or args.inference or args.notes),
                "shapes one plan's text (with --largest, the grown model's); leave out --search, --validate, "
                "--inference and --notes")
               for option, on in (("--tiers", args.tiers), ("--memory-table", args.memory_table)))]
    for option, refused, why in alone:
        if refused:
            raise ConfigError(f"{option}: {why}")
    written = [("--out", args.out, True)] if args.measure else []  # not its default's unless it writes there
    written += [("--catalogue", args.catalogue or user_path(), False)] if args.calibrate else []
    for option, path, folder in written:
        if (why := unwritable(path, folder)) is not None:
            raise ConfigError(f"{option}: {why}")


def run(args) -> int:
    from mpitrain.comm import launcher_rank
    from mpitrain.plan import hardware

    _refuse_combinations(args)
    args.steps = args.steps or 20
    if launcher_rank() not in (None, 0) and not args.validate:  # under mpiexec: one plan, printed once
        return 0
    if args.inference:
        from mpitrain.plan import serving

        return serving.run(args)
    if args.calibrate:
        from mpitrain.plan import calibrate

        calibrate.calibrate(out=args.catalogue, log=print, busy_ok=args.busy_ok)
        return 0
    if args.notes:
        from mpitrain.plan import models

        catalogue = hardware.load(args.catalogue)
        print(models.notes_text(catalogue.notes, catalogue.devices.get("h100")))
        return 0
    if args.validate:
        from mpitrain.plan import validate

        return validate.run(args)
    if args.largest:
        from mpitrain.plan import largest

        return largest.run(args)
    if args.search:
        from mpitrain.plan import search

        return search.run(args)
    from mpitrain import plan as planner

    plan, source = planner.from_args(args)
    from mpitrain.plan import show

    text = show.text(plan, source, memory=args.hardware != "this" or args.memory_table, tiers=args.tiers)
    print(text)
    if args.html:
        from mpitrain.plan import page

        print(f"wrote {page.write(args.html, plan, text, f'mpitrain plan: {source}')}")
    sys.stdout.flush()
    return 0 if plan.largest().peak <= plan.machine.memory else DOES_NOT_FIT
