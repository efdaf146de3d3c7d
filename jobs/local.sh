#!/usr/bin/env bash
# Train one job on this machine with MPI ranks, with any strategy.
#
#   jobs/local.sh STRATEGY CONFIG [RANKS] [mpitrain train options...]
#   jobs/local.sh ddp jobs/tinyshakespeare_gpt.toml 2
#   jobs/local.sh zero1 jobs/mnist5k_lenet.toml 2 --set train.epochs=2
#   jobs/local.sh ddp-ring jobs/tinyshakespeare_gpt.toml 2 --resume
#   jobs/local.sh ps-async jobs/mnist_lenet.toml 4 --set train.global_batch_size=63
#   jobs/local.sh pp jobs/shakespeare_gpt.toml 2 --set parallel.schedule=zb-h1
#
# STRATEGY: ddp (MPI allreduce), ddp-ring (mpitrain's ring allreduce), zero1 (optimizer
# state sharded), ps (1 parameter server, the other ranks synchronous workers),
# ps-async (the same, asynchronous), pp (two pipeline stages, 1F1B over 6 micro-batches per
# data-parallel lane: the global batch must divide by 6 x the lanes). RANKS defaults to the number of cores; each rank
# gets cores / ranks BLAS threads (mpitrain sets them). The run directory is
# runs/<config name> (jobs/README.md, "Checkpoints, resume and signals"); --resume continues
# one (ddp, zero1, pp).
set -euo pipefail
usage() { sed -n '2,17p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }
[ $# -ge 2 ] || usage
strategy=$1 config=$2
shift 2
ranks=$(nproc)
if [ $# -gt 0 ] && [[ $1 =~ ^[0-9]+$ ]]; then ranks=$1; shift; fi
case $strategy in
    ddp) set -- --set parallel.sync='"ddp"' "$@" ;;
    ddp-ring) set -- --set parallel.sync='"ddp"' --set parallel.allreduce='"ring"' "$@" ;;
    zero1) set -- --set parallel.sync='"zero1"' "$@" ;;
    ps) set -- --set parallel.sync='"ps"' "$@" ;;
    ps-async) set -- --set parallel.sync='"ps"' --set parallel.staleness=-1 "$@" ;;
    pp) set -- --set parallel.pp=2 --set train.micro_batches=6 "$@" ;;
    *) echo "jobs/local.sh: unknown strategy '$strategy' (ddp, ddp-ring, zero1, ps, ps-async, pp)" >&2; exit 2 ;;
esac
[ -f "$config" ] || { echo "jobs/local.sh: no config file '$config'" >&2; exit 2; }
# through mpitrain launch: Ctrl-C, pressed once or more, ends in a checkpoint (jobs/README.md, "Signals")
exec mpitrain launch mpiexec -n "$ranks" mpitrain train "$config" "$@"
