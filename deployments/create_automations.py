"""Create (or replace, by name) the automations in deployments/automations.yaml on the current Prefect server.

Usage: python deployments/create_automations.py [--notify-block slack-webhook/eagle3-alerts]

Automations that need no block (marking runs whose heartbeats stopped as Crashed) are always created; the
notifications only with --notify-block, the notification block whose id replaces `__NOTIFY_BLOCK_ID__`.
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


def load_automations(path: Path, notify_block_id: str | None) -> list[AutomationCore]:
    """Every automation of the file; without a block id, those that need none."""
    items: list[dict[str, Any]] = yaml.safe_load(path.read_text())["automations"]
    if notify_block_id is None:
        items = [item for item in items if PLACEHOLDER not in yaml.safe_dump(item)]
    text = yaml.safe_dump(items).replace(PLACEHOLDER, notify_block_id or PLACEHOLDER)
    return [AutomationCore.model_validate(item) for item in yaml.safe_load(text)]


async def create(path: Path, notify_block: str | None) -> list[tuple[str, str]]:
    block_id = None
    if notify_block is not None:
        block = await Block.aload(notify_block)
        if block._block_document_id is None:
            raise SystemExit(f"block {notify_block} has no document id")
        block_id = str(block._block_document_id)
    created = []
    async with get_client() as client:
        for automation in load_automations(path, block_id):
            for existing in await client.read_automations_by_name(automation.name):
                await client.delete_automation(existing.id)
            created.append((automation.name, str(await client.create_automation(automation))))
    return created


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--notify-block", help="block slug/name, e.g. slack-webhook/eagle3-alerts")
    parser.add_argument("--file", type=Path, default=HERE / "automations.yaml")
    args = parser.parse_args()
    for name, automation_id in asyncio.run(create(args.file, args.notify_block)):
        print(f"created automation {name!r} ({automation_id})")
    if args.notify_block is None:
        print("no --notify-block: skipped the notification automations (see deployments/automations.yaml)")


if __name__ == "__main__":
    main()
