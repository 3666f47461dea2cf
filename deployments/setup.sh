#!/usr/bin/env bash
# One-time (idempotent) setup of a Prefect server for eagle3-datagen: work pools, block types, deployments,
# automations. Run from the repository root with PREFECT_API_URL pointing at the server.
#   EAGLE3_NOTIFY_BLOCK=slack-webhook/eagle3-alerts deployments/setup.sh
# Block *documents* (your endpoint key, store location, GPU backend) are created by you, see README.
set -euo pipefail
cd "$(dirname "$0")/.."
export EAGLE3_DATAGEN_HOME="${EAGLE3_DATAGEN_HOME:-$PWD}"
: "${PREFECT_API_URL:?set PREFECT_API_URL to your Prefect server, e.g. http://127.0.0.1:4200/api}"

prefect --no-prompt work-pool create eagle3-cpu --type process --overwrite
prefect --no-prompt work-pool create eagle3-gpu --type process --overwrite
# One extraction at a time on the GPU pool: the model fills the GPU.
prefect --no-prompt work-pool set-concurrency-limit eagle3-gpu 1

prefect --no-prompt block register -m blocks
prefect --no-prompt deploy --prefect-file deployments/prefect.yaml --all
# Failure notifications need a notification block you created (Slack, email, ...): name it in EAGLE3_NOTIFY_BLOCK.
if [ -n "${EAGLE3_NOTIFY_BLOCK:-}" ]; then
  python deployments/create_automations.py --notify-block "$EAGLE3_NOTIFY_BLOCK"
else
  echo "EAGLE3_NOTIFY_BLOCK unset: skipped automations (see deployments/automations.yaml)"
fi
