#!/usr/bin/env bash
# One-time (idempotent) setup of a Prefect server for eagle3-datagen: work pools, block types, deployments,
# automations (crash detection always; notifications with EAGLE3_NOTIFY_BLOCK), and with EAGLE3_STORE_URL the
# shared run store. Run from the repository root with PREFECT_API_URL pointing at the server.
#   EAGLE3_STORE_URL=s3://eagle3/runs EAGLE3_NOTIFY_BLOCK=slack-webhook/eagle3-alerts deployments/setup.sh
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
# prefect.yaml ships the nightly schedule paused; a schedule you resumed stays resumed across this deploy.
schedules="$(mktemp)"
trap 'rm -f "$schedules"' EXIT
python deployments/schedule_state.py save "$schedules"
prefect --no-prompt deploy --prefect-file deployments/prefect.yaml --all
python deployments/schedule_state.py restore "$schedules"
# pipeline and nightly-rerun write the same run directory: one shared concurrency slot, a second run queues.
python deployments/run_dir_concurrency.py
# EAGLE3_DEMO_BLOCKS=1: save the blocks the deployments name that do not exist yet (yours are kept; =force
# overwrites them), pointing at the local simulator (EAGLE3_DEMO_ENDPOINT, default http://127.0.0.1:30000) and
# EAGLE3_DEMO_RUNS_DIR (default runs/; the worker images set /runs, the volume every worker of docker/compose.yaml
# mounts).
if [ -n "${EAGLE3_DEMO_BLOCKS:-}" ]; then
  force=()
  if [ "$EAGLE3_DEMO_BLOCKS" = force ]; then force=(--force); fi
  python deployments/demo_blocks.py --endpoint-url "${EAGLE3_DEMO_ENDPOINT:-http://127.0.0.1:30000}" \
    --runs-dir "${EAGLE3_DEMO_RUNS_DIR:-runs}" ${force[@]+"${force[@]}"}
fi
# EAGLE3_STORE_URL=s3://bucket/prefix: the run store the workers share (README, "Several hosts"): the bucket is
# created if missing, this host must be able to write there, and the eagle3-runs block points at it.
if [ -n "${EAGLE3_STORE_URL:-}" ]; then
  python deployments/store_block.py "$EAGLE3_STORE_URL"
fi
# Automations: runs whose heartbeats stopped (their host died) are marked Crashed, always; failure notifications
# need a notification block you created (Slack, email, ...): name it in EAGLE3_NOTIFY_BLOCK.
if [ -n "${EAGLE3_NOTIFY_BLOCK:-}" ]; then
  python deployments/create_automations.py --notify-block "$EAGLE3_NOTIFY_BLOCK"
else
  python deployments/create_automations.py
fi
