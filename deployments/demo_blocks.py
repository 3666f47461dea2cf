"""Save the three blocks the shipped deployments name, pointing at the local endpoint simulator, so the Run button
works on a fresh setup before any real endpoint or key exists. Only blocks that do not exist yet are saved: the
README recommends re-running setup.sh to redeploy, and that silently reset a user's own blocks to the demo's (the
endpoint's API key to none). `--force` saves all three over whatever is there.

    python deployments/demo_blocks.py --endpoint-url http://127.0.0.1:30000 --runs-dir runs [--force]
"""

from __future__ import annotations

import argparse
from pathlib import Path

from prefect.blocks.core import Block
from prefect.client.orchestration import get_client
from prefect.exceptions import ObjectNotFound

from blocks import ArtifactStoreBlock, HiddenStateBackendBlock, InferenceEndpointBlock


def demo_blocks(endpoint_url: str, runs_dir: str) -> dict[str, Block]:
    return {
        "eagle3-endpoint": InferenceEndpointBlock(
            kind="sglang_generate", base_url=endpoint_url, model="sim/deepseek-v4-sim", max_in_flight=64
        ),
        "eagle3-runs": ArtifactStoreBlock(location=str(Path(runs_dir).resolve())),
        "eagle3-gpu-backend": HiddenStateBackendBlock(backend="hf", device="cpu", dtype="bfloat16"),
    }


def exists(block: Block, name: str) -> bool:
    with get_client(sync_client=True) as client:
        try:
            client.read_block_document_by_name(name, block.get_block_type_slug(), include_secrets=False)
        except ObjectNotFound:
            return False
    return True


def save_missing(blocks: dict[str, Block], force: bool) -> tuple[list[str], list[str]]:
    """(saved, kept): the names saved now, and those left as they were."""
    saved, kept = [], []
    for name, block in blocks.items():
        if not force and exists(block, name):
            kept.append(name)
            continue
        block.save(name, overwrite=True)
        saved.append(name)
    return saved, kept


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--endpoint-url", default="http://127.0.0.1:30000", help="the running simulator's URL")
    parser.add_argument("--runs-dir", default="runs", help="where run directories go (a path every worker sees)")
    parser.add_argument("--force", action="store_true", help="overwrite blocks of these names that exist already")
    args = parser.parse_args(argv)
    saved, kept = save_missing(demo_blocks(args.endpoint_url, args.runs_dir), args.force)
    if saved:
        print(f"saved demo blocks {', '.join(saved)}")
    if kept:
        print(f"kept existing blocks {', '.join(kept)} (EAGLE3_DEMO_BLOCKS=force, or --force, overwrites them)")


if __name__ == "__main__":
    main()
