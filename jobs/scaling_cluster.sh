#!/usr/bin/env bash
# A scaling study over an emulated network (mpitrain cluster: needs root and iproute2):
# the same job on 1 rank, on one node of 2 ranks, and on emulated nodes of 1 or 2 ranks
# linked at each RATE, for each strategy; then samples/s and efficiency against ranks,
# with each point's exposed communication and the planner's prediction beside each line
# (scaling.png; mpitrain report prints each point's error and their mean).
#
#   jobs/scaling_cluster.sh CONFIG [-- mpitrain train options...]
#   jobs/scaling_cluster.sh jobs/shakespeare_gpt.toml -- --set train.steps=60 --set train.global_batch_size=24
#
# Environment: RATES (default "1gbit 10gbit"), LAYOUTS (NODESxRANKS, default "2x1 4x1
# 2x2 4x2"), STRATEGIES (default "ddp zero1 ps-async"), SLOW (ps-async: worker 0 is a
# straggler SLOW times slower, default 2). ps-async has one server, or as many as it
# takes for the workers to divide the global batch. Global-norm clipping is turned off
# in every run (parameter servers cannot clip by it), so every strategy trains alike,
# and every rank has one BLAS thread: the 1-rank run is one core, as each rank's share.
# With more ranks than cores the cluster runs time-dilated (--dilation auto): links and
# cores slowed alike, the report multiplies the throughput back. Runs go to
# runs/scaling-cluster/<config name>/<strategy>-<where> (replaced if they exist), the
# plot and summaries to runs/scaling-cluster/<config name>/.
set -euo pipefail
usage() { sed -n '2,20p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }
[ $# -ge 1 ] || usage
config=$1
shift
[ -f "$config" ] || { echo "jobs/scaling_cluster.sh: no config file '$config'" >&2; exit 2; }
[ "${1:-}" = "--" ] && shift
options=("$@" --set optim.grad_clip=0.0 --set train.threads=1)
rates=(${RATES:-1gbit 10gbit})
layouts=(${LAYOUTS:-2x1 4x1 2x2 4x2})
strategies=(${STRATEGIES:-ddp zero1 ps-async})
for layout in "${layouts[@]}"; do
    [[ $layout =~ ^[1-9][0-9]*x[1-9][0-9]*$ ]] || { echo "jobs/scaling_cluster.sh: layout '$layout' is not NODESxRANKS" >&2; exit 2; }
done
for strategy in "${strategies[@]}"; do
    case $strategy in ddp|zero1|ps-async) ;; *) echo "jobs/scaling_cluster.sh: strategy '$strategy' is not ddp, zero1 or ps-async" >&2; exit 2 ;; esac
done
# the model (a GPT's closing text sample is no part of the timing: skipped) and the
# global batch (the parameter servers' count depends on it), from the config with the
# options, which this also checks before any run
read -r model batch < <(python3 -c '
import sys
from mpitrain.cli import build_parser
from mpitrain.config import ConfigError, load
args = build_parser().parse_args(["train", *sys.argv[1:]])
try:
    cfg = load(args.config, args.set)
except ConfigError as e:
    print(f"mpitrain: error: {e}", file=sys.stderr)
    sys.exit(2)
print(cfg.model.name, cfg.train.global_batch_size)
' "$config" "${options[@]}") || exit 2
[ "$model" = gpt ] && options+=(--set train.sample_tokens=0)
name=$(basename "$config" .toml)
root=runs/scaling-cluster/$name

# the settings of STRATEGY on P ranks [links of RATE]: ddp's buckets take 2 ms of the
# link (mpitrain/parallel/data_parallel.py, "Across a network")
settings() {
    case $1 in
        ddp)
            local bucket=""
            [ -n "${3:-}" ] && bucket="--set parallel.bucket_mb=$(python3 -c 'import sys
from mpitrain.cluster import link_bucket_mb
print(f"{link_bucket_mb(sys.argv[1]):.3g}")' "$3")"
            echo "--set parallel.sync=\"ddp\" $bucket" ;;
        zero1) echo "--set parallel.sync=\"zero1\"" ;;
        ps-async)
            local servers=1
            while [ $((batch % ($2 - servers))) -ne 0 ]; do servers=$((servers + 1)); done
            echo "--set parallel.sync=\"ps\" --set parallel.staleness=-1 --set parallel.servers=$servers" \
                 "--set parallel.slow_worker=0 --set parallel.slow_factor=${SLOW:-2}" ;;
    esac
}

runs=()
train() {  # DIR LAUNCH... -- STRATEGY SETTINGS...
    local dir=$1; shift
    rm -rf "$dir"
    echo "== $dir"
    "$@" --run-dir "$dir" "${options[@]}" 2>&1 | grep -E "^(emulated|time dilation|done:|mpitrain: error)" || true
    [ -f "$dir/metrics.jsonl" ] && grep -q '"kind": "end"' "$dir/metrics.jsonl" || { echo "run $dir did not finish" >&2; exit 1; }
    runs+=("$dir")
}

train "$root/p1" mpitrain train "$config"
for strategy in "${strategies[@]}"; do
    read -r -a set < <(settings "$strategy" 2)
    train "$root/$strategy-1x2" mpiexec -n 2 mpitrain train "$config" "${set[@]}"
done
for rate in "${rates[@]}"; do
    for layout in "${layouts[@]}"; do
        nodes=${layout%x*} per_node=${layout#*x}
        for strategy in "${strategies[@]}"; do
            read -r -a set < <(settings "$strategy" $((nodes * per_node)) "$rate")
            train "$root/$strategy-$rate-$layout" mpitrain cluster --nodes "$nodes" --ranks "$per_node" --rate "$rate" \
                --dilation auto -- mpitrain train "$config" "${set[@]}"
        done
    done
done
mpitrain report "${runs[@]}" --out "$root" | grep -E "^scaling:|scaling\.png$"
