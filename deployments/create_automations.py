"""Create (or replace, by name) the automations in deployments/automations.yaml on the current Prefect server.

Usage: python deployments/create_automations.py --notify-block slack-webhook/eagle3-alerts
"""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path
from typing import Any

import yaml
from prefect.blocks.core import Block
from prefect.client.orchestration import get_client
from prefect.events.schemas.automations import AutomationCore

PLACEHOLDER = "__NOTIFY_BLOCK_ID__"
HERE = Path(__file__).resolve().parent


def load_automations(path: Path, notify_block_id: str) -> list[AutomationCore]:
    text = path.read_text().replace(PLACEHOLDER, notify_block_id)
    data: dict[str, Any] = yaml.safe_load(text)
    return [AutomationCore.model_validate(item) for item in data["automations"]]


async def create(path: Path, notify_block: str) -> list[str]:
    block = await Block.aload(notify_block)
    if block._block_document_id is None:
        raise SystemExit(f"block {notify_block} has no document id")
    automations = load_automations(path, str(block._block_document_id))
    created = []
    async with get_client() as client:
        for automation in automations:
            for existing in await client.read_automations_by_name(automation.name):
                await client.delete_automation(existing.id)
            created.append(str(await client.create_automation(automation)))
    return created


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--notify-block", required=True, help="block slug/name, e.g. slack-webhook/eagle3-alerts")
    parser.add_argument("--file", type=Path, default=HERE / "automations.yaml")
    args = parser.parse_args()
    for automation_id in asyncio.run(create(args.file, args.notify_block)):
        print(f"created automation {automation_id}")


if __name__ == "__main__":
    main()
