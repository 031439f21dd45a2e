#!/usr/bin/env bash
# The one prepared GPU check (see scripts/gpu_check.py for what each check measures).
#   bash scripts/gpu_check.sh            on one GPU: installs the wheels carried in .whl/
#                                        (scripts/gpu_wheels.sh makes them), then runs every check,
#                                        most valuable first, each within its time limit: < 6 min
#   bash scripts/gpu_check.sh --dry-run  lists the checks and their time limits (any machine, CI)
# Figures: $OUT (device machine) or outputs/gpu_check/: gpu_check.json and gpu.md, nothing else;
# scripts/gpu_targets.py records a run in docs/gpu.md.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
if [[ "${1:-}" == "--dry-run" ]]; then
  exec "$PY" scripts/gpu_check.py --dry-run "${@:2}"
fi
if compgen -G ".whl/*.whl" > /dev/null; then
  # the device image lacks the project's config stack (hydra, omegaconf): carried as wheels
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/scape_site .whl/*.whl
  export PYTHONPATH="/tmp/scape_site:${PYTHONPATH:-}"
fi
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 WANDB_MODE=disabled
# the checks stop themselves by 340 s (gpu_check.py: DEADLINE_S); this is the backstop
exec timeout --kill-after=5 352 "$PY" scripts/gpu_check.py "$@"
