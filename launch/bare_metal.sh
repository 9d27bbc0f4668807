#!/usr/bin/env bash
# placerun in place of torchrun on bare metal: one command per node.
#
#   launch/bare_metal.sh examples/train_ddp.py --steps 100          # this node, one rank per GPU
#   NPROC_PER_NODE=2 launch/bare_metal.sh examples/train_ddp.py     # CPU box: 2 ranks on gloo
#   NNODES=2 MASTER_ADDR=10.0.0.1 launch/bare_metal.sh train.py     # run the same line on every node
#   PLACERUN_ARGS="placement.policy=exclusive placement.tune.enabled=false" launch/bare_metal.sh train.py
#   METRICS_PORT=9450 launch/bare_metal.sh train.py     # live metrics on http://<this node>:9450/metrics
#
# Environment: NNODES (1), NPROC_PER_NODE (GPUs seen by nvidia-smi, else 1), MASTER_ADDR and
# MASTER_PORT (29500) of the c10d rendezvous when NNODES > 1, RDZV_ID (placement), PLACERUN_ARGS
# (more placerun words: placement.KEY=VALUE overrides, --dry-run), METRICS_PORT (live metrics; off when
# unset), PLACEMENT_DOCTOR=0 to skip the host checks printed before the start.
set -euo pipefail

if [ $# -lt 1 ]; then
    echo "usage: $0 TRAINING_SCRIPT [ARGS...]   (see the header of $0 for the environment it reads)" >&2
    exit 2
fi

nnodes="${NNODES:-1}"
nproc="${NPROC_PER_NODE:-}"
if [ -z "$nproc" ]; then
    nproc="$( (nvidia-smi -L 2>/dev/null || true) | grep -c '^GPU' || true)"
    [ "$nproc" -gt 0 ] || nproc=1
fi
read -r -a extra <<< "${PLACERUN_ARGS:-}"
# METRICS_PORT: each node's placerun serves its ranks' live metrics on http://<node>:$METRICS_PORT/metrics
# for Prometheus to scrape (placement.metrics.port; off when unset, docs/monitor.md, live metrics).
if [ -n "${METRICS_PORT:-}" ]; then extra+=("placement.metrics.port=$METRICS_PORT"); fi

if [ "$nnodes" = 1 ]; then
    rdzv=(--standalone)
else
    : "${MASTER_ADDR:?MASTER_ADDR (the first node) is needed when NNODES > 1}"
    rdzv=(--nnodes="$nnodes" --rdzv-backend=c10d --rdzv-endpoint="$MASTER_ADDR:${MASTER_PORT:-29500}"
          --rdzv-id="${RDZV_ID:-placement}")
fi

# The host checks go to the job log first; problems are reported, not fatal.
if [ "${PLACEMENT_DOCTOR:-1}" = 1 ]; then
    placement doctor --nproc-per-node "$nproc" || echo "$0: placement doctor reported problems (above); starting anyway" >&2
fi

exec placerun "${rdzv[@]}" --nproc-per-node="$nproc" "${extra[@]}" "$@"
