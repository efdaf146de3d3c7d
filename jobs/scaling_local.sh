#!/usr/bin/env bash
# A scaling study on this machine: the same job (same global batch) on 1, 2, ... ranks,
# then the epoch time and parallel efficiency against ranks (scaling.png): a strong-
# scaling study, the global batch fixed while the ranks grow.
#
#   jobs/scaling_local.sh CONFIG [RANKS...] [-- mpitrain train options...]
#   jobs/scaling_local.sh jobs/mnist5k_lenet.toml 1 2 -- --set train.epochs=2
#
# RANKS default to "1 2". Each point runs REPEATS times (default 3), the rank counts taken
# in turn within each repeat, so that a drift of the machine's speed spreads over all of
# them; the report gives each point's median and its range over the repeats. Runs go to
# runs/scaling/<config name>-p<ranks>-r<repeat> (replaced if they exist), the plot and
# summaries to runs/scaling/<config name>/. With more ranks than cores the ranks share
# cores, and the figures measure that, not the method.
set -euo pipefail
usage() { sed -n '2,14p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }
[ $# -ge 1 ] || usage
config=$1
shift
[ -f "$config" ] || { echo "jobs/scaling_local.sh: no config file '$config'" >&2; exit 2; }
ranks=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do
    [[ $1 =~ ^[1-9][0-9]*$ ]] || { echo "jobs/scaling_local.sh: '$1' is not a rank count" >&2; exit 2; }
    ranks+=("$1"); shift
done
[ $# -gt 0 ] && shift  # the --
[ ${#ranks[@]} -gt 0 ] || ranks=(1 2)
repeats=${REPEATS:-3}
[[ $repeats =~ ^[1-9][0-9]*$ ]] || { echo "jobs/scaling_local.sh: REPEATS='$repeats' is not a count" >&2; exit 2; }
# The GPT's closing text sample is no part of the timing, so it is skipped; but
# train.sample_tokens is a text-model field that image configs refuse, so ask the config
# (with the --set options, also checking them before any run) which model it trains.
model=$(python3 -c '
import sys
from mpitrain.cli import build_parser
from mpitrain.config import ConfigError, load
args = build_parser().parse_args(["train", *sys.argv[1:]])
try:
    print(load(args.config, args.set).model.name)
except ConfigError as e:
    print(f"mpitrain: error: {e}", file=sys.stderr)
    sys.exit(2)
' "$config" "$@")
no_sample=()
if [ "$model" = gpt ]; then no_sample=(--set train.sample_tokens=0); fi
name=$(basename "$config" .toml)
runs=()
for r in $(seq 1 "$repeats"); do
    for p in "${ranks[@]}"; do
        run=runs/scaling/$name-p$p-r$r
        rm -rf "$run"
        echo "== $p rank(s), repeat $r of $repeats: $run"
        mpiexec -n "$p" mpitrain train "$config" --run-dir "$run" "${no_sample[@]}" "$@" 2>&1 | tail -n 4
        runs+=("$run")
    done
done
mpitrain report "${runs[@]}" --out "runs/scaling/$name"
