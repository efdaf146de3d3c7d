#!/usr/bin/env bash
# A scaling study on this machine: the same job (same global batch) on 1, 2, ... ranks,
# then the epoch time and parallel efficiency against ranks (scaling.png), as in the
# seed slides' ResNet-50 study.
#
#   jobs/scaling_local.sh CONFIG [RANKS...] [-- mpitrain train options...]
#   jobs/scaling_local.sh jobs/mnist5k_lenet.toml 1 2 -- --set train.epochs=2
#
# RANKS default to "1 2". Runs go to runs/scaling/<config name>-p<ranks> (replaced if
# they exist), the plot and summaries to runs/scaling/<config name>/. With more ranks
# than cores the ranks share cores, and the figures measure that, not the method.
set -euo pipefail
usage() { sed -n '2,12p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }
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
name=$(basename "$config" .toml)
runs=()
for p in "${ranks[@]}"; do
    run=runs/scaling/$name-p$p
    rm -rf "$run"
    echo "== $p rank(s): $run"
    mpiexec -n "$p" mpitrain train "$config" --run-dir "$run" --set train.sample_tokens=0 "$@" 2>&1 | tail -n 4
    runs+=("$run")
done
mpitrain report "${runs[@]}" --out "runs/scaling/$name"
