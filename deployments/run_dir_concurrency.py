"""One concurrency key for every deployment that writes a run directory (`pipeline`, `nightly-rerun`): the
global concurrency limit `eagle3-run-dir-writers` (one slot), linked to both deployments with the ENQUEUE
strategy, so a second trigger waits as AwaitingConcurrencySlot until the first finishes, instead of starting and
failing on the run directory's writer lock (RunDirBusyError). Prefect holds and releases the slot with the run
(a crashed or cancelled run frees it); the writer lock stays as the guard for runs outside these deployments.

A deployment's own `concurrency_limit` (prefect.yaml) cannot be shared, and `prefect deploy` cannot name a global
limit, so deployments/setup.sh runs this after every `prefect deploy`:

    python deployments/run_dir_concurrency.py
"""

from __future__ import annotations

import argparse
from uuid import UUID

from prefect.client.orchestration import SyncPrefectClient, get_client
from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate
from prefect.exceptions import ObjectNotFound

LIMIT_NAME = "eagle3-run-dir-writers"
WRITERS = ("eagle3-pipeline/pipeline", "eagle3-pipeline/nightly-rerun")


def ensure_limit(client: SyncPrefectClient, name: str = LIMIT_NAME) -> UUID:
    """The limit's id; created with one slot when missing (an existing one keeps the slots a user gave it)."""
    try:
        return client.read_global_concurrency_limit_by_name(name).id
    except ObjectNotFound:
        return client.create_global_concurrency_limit(GlobalConcurrencyLimitCreate(name=name, limit=1))


def link(client: SyncPrefectClient, deployments: tuple[str, ...] = WRITERS) -> UUID:
    limit_id = ensure_limit(client)
    for name in deployments:
        deployment = client.read_deployment_by_name(name)
        body = {"global_concurrency_limit_id": str(limit_id), "concurrency_options": {"collision_strategy": "ENQUEUE"}}
        client.request("PATCH", "/deployments/{id}", path_params={"id": deployment.id}, json=body)
    return limit_id


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.parse_args(argv)
    with get_client(sync_client=True) as client:
        link(client)
    print(f"deployments {', '.join(WRITERS)} share the concurrency limit {LIMIT_NAME} (one run at a time, queued)")


if __name__ == "__main__":
    main()
