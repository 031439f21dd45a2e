#!/usr/bin/env bash
# One node, all its GPUs (or NPROC CPU processes on gloo). Arguments go to Hydra:
#   scripts/launch_torchrun.sh +experiment=llama500m_s99 trainer.max_steps=10000
#   NPROC=4 scripts/launch_torchrun.sh +experiment=tiny_s99          # 4 ranks on a CPU machine
# NPROC defaults to the number of visible GPUs (1 if none).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
NPROC=${NPROC:-$("$PY" -c "import torch; print(max(1, torch.cuda.device_count()))")}
# Split the cores evenly between ranks so CPU runs do not oversubscribe.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( $(nproc) / NPROC > 0 ? $(nproc) / NPROC : 1 ))}
source scripts/preemption.sh   # how long torchrun's agent waits for a checkpoint on SIGTERM
exec "$PY" -m torch.distributed.run --standalone --nproc_per_node="$NPROC" \
  --shutdown_timeout="$TORCH_ELASTIC_SHUTDOWN_TIMEOUT" -m scape_train "$@"
