#!/usr/bin/env bash
# Set-up and run in one step, on a fresh machine or a reused one.
#   ./dev.sh job    the main job: a real 2-rank CPU training run under placerun, monitor on
#   ./dev.sh test   the test suite (what CI runs)
# Creates or reuses .venv, installs torch only when it is missing, installs the project, then runs.
set -euo pipefail
cd "$(dirname "$0")"
venv="${PLACEMENT_VENV:-.venv}"
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
py="$venv/bin/python"
# torch==2.13.0 is a CPU build on our dev machines and the normal CUDA build elsewhere;
# an existing torch (any build) is kept so a user's GPU install is never replaced.
"$py" -c 'import torch' 2>/dev/null || "$py" -m pip install -q torch==2.13.0
# Re-install the project only when its metadata or the extras asked for changed (the install is
# editable). The tests need Ray (a real local cluster); the main job does not, so a first run stays short.
extras="dev,megatron,lightning,transformers,accelerate,metrics"
[ "${1:-}" = test ] && extras="$extras,ray"
stamp="$venv/.placement-installed"
want="$(sha256sum pyproject.toml | cut -d' ' -f1) $extras"
if ! grep -qxF "$want" "$stamp" 2>/dev/null; then
    "$py" -m pip install -q -e ".[$extras]"
    echo "$want" >> "$stamp"
fi
export PATH="$PWD/$venv/bin:$PATH"
cmd="${1:-}"; shift || true
case "$cmd" in
    job)
        logdir="${PLACEMENT_LOG_DIR:-placement_logs/main-job}"
        rm -rf "$logdir"
        placerun --standalone --nproc-per-node 2 placement.monitor.log_dir="$logdir" \
            examples/train_ddp.py --steps 60 --workers 2 "$@"
        placement report "$logdir"/*.jsonl --plot "$logdir/report.png"
        ;;
    test)
        # The live-metrics tests query a real Prometheus server (Debian's package; it is not
        # started here: each test starts its own on a private port). RUNLEVEL=1 keeps the
        # package's service from starting on :9090.
        if ! command -v prometheus >/dev/null && command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
            RUNLEVEL=1 DEBIAN_FRONTEND=noninteractive apt-get install -y -q prometheus >/dev/null 2>&1 \
                || { apt-get update -q >/dev/null 2>&1 && RUNLEVEL=1 DEBIAN_FRONTEND=noninteractive \
                     apt-get install -y -q prometheus >/dev/null 2>&1; } \
                || echo "dev.sh: prometheus could not be installed; the live-metrics server tests will skip" >&2
        fi
        set +e
        "$py" -m pytest -q "$@"
        rc=$?
        # pytest exits 5 when it collected no tests: that is a failure, not a pass.
        if [ "$rc" -eq 5 ]; then echo "dev.sh: pytest collected no tests" >&2; exit 1; fi
        exit "$rc"
        ;;
    *)
        echo "usage: ./dev.sh job|test [args]" >&2; exit 2 ;;
esac
