#!/usr/bin/env bash
# Train one job on this machine with MPI ranks, with any strategy.
#
#   jobs/local.sh STRATEGY CONFIG [RANKS] [mpitrain train options...]
#   jobs/local.sh ddp jobs/tinyshakespeare_gpt.toml 2
#   jobs/local.sh zero1 jobs/mnist5k_lenet.toml 2 --set train.epochs=2
#   jobs/local.sh ddp-ring jobs/tinyshakespeare_gpt.toml 2 --resume
#
# STRATEGY: ddp (MPI allreduce), ddp-ring (mpitrain's ring allreduce), zero1 (optimizer
# state sharded). RANKS defaults to the number of cores; each rank gets cores / ranks
# BLAS threads (mpitrain sets them). The run directory is runs/<config name> (see
# README.md, "Checkpoints, resume and signals"); pass --resume to continue one.
set -euo pipefail
usage() { sed -n '2,13p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }
[ $# -ge 2 ] || usage
strategy=$1 config=$2
shift 2
ranks=$(nproc)
if [ $# -gt 0 ] && [[ $1 =~ ^[0-9]+$ ]]; then ranks=$1; shift; fi
case $strategy in
    ddp) set -- --set parallel.strategy='"ddp"' "$@" ;;
    ddp-ring) set -- --set parallel.strategy='"ddp"' --set parallel.allreduce='"ring"' "$@" ;;
    zero1) set -- --set parallel.strategy='"zero1"' "$@" ;;
    *) echo "jobs/local.sh: unknown strategy '$strategy' (ddp, ddp-ring, zero1)" >&2; exit 2 ;;
esac
[ -f "$config" ] || { echo "jobs/local.sh: no config file '$config'" >&2; exit 2; }
exec mpiexec -n "$ranks" mpitrain train "$config" "$@"
