"""Keeps a schedule the user turned on turned on across `prefect deploy`.

`deployments/prefect.yaml` ships the nightly rerun's schedule paused (`active: false`) until the config and
blocks describe a real run; `prefect deploy` writes the schedules it declares, so re-running the idempotent
deployments/setup.sh used to pause a nightly rerun the user had resumed, silently. setup.sh saves which
schedules are active before deploying and resumes the same ones (same cron and timezone) after:

    python deployments/schedule_state.py save FILE      # before `prefect deploy`
    python deployments/schedule_state.py restore FILE   # after it
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from prefect.client.orchestration import SyncPrefectClient, get_client
from prefect.exceptions import ObjectNotFound

SCHEDULED = ("eagle3-pipeline/nightly-rerun",)


def _key(schedule: Any) -> str:
    """A schedule's identity across deploys (its id changes): what it fires on."""
    return json.dumps(schedule.schedule.model_dump(mode="json"), sort_keys=True)


def active_schedules(client: SyncPrefectClient, names: tuple[str, ...] = SCHEDULED) -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for name in names:
        try:
            deployment = client.read_deployment_by_name(name)
        except ObjectNotFound:
            continue
        found[name] = [_key(s) for s in client.read_deployment_schedules(deployment.id) if s.active]
    return found


def resume(client: SyncPrefectClient, saved: dict[str, list[str]]) -> list[str]:
    """Resume the schedules that were active before; returns the deployments touched."""
    resumed = []
    for name, keys in saved.items():
        deployment = client.read_deployment_by_name(name)
        for schedule in client.read_deployment_schedules(deployment.id):
            if not schedule.active and _key(schedule) in keys:
                client.update_deployment_schedule(deployment.id, schedule.id, active=True)
                resumed.append(name)
    return resumed


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("action", choices=["save", "restore"])
    parser.add_argument("file", type=Path)
    args = parser.parse_args(argv)
    with get_client(sync_client=True) as client:
        if args.action == "save":
            args.file.write_text(json.dumps(active_schedules(client)))
            return
        resumed = resume(client, json.loads(args.file.read_text()))
    for name in resumed:
        print(f"{name}: its schedule was active before this deploy and stays active")


if __name__ == "__main__":
    main()
