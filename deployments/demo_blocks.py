"""Save the three blocks the shipped deployments name, pointing at the local endpoint simulator, so the Run button
works on a fresh setup before any real endpoint or key exists. Overwrites blocks of the same names: replace them
with your own (README, "Run it on Prefect", step 2) before a real run.

    python deployments/demo_blocks.py --endpoint-url http://127.0.0.1:30000 --runs-dir runs
"""

from __future__ import annotations

import argparse
from pathlib import Path

from blocks import ArtifactStoreBlock, HiddenStateBackendBlock, InferenceEndpointBlock


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--endpoint-url", default="http://127.0.0.1:30000", help="the running simulator's URL")
    parser.add_argument("--runs-dir", default="runs", help="where run directories go (a path every worker sees)")
    args = parser.parse_args(argv)
    InferenceEndpointBlock(
        kind="sglang_generate", base_url=args.endpoint_url, model="sim/deepseek-v4-sim", max_in_flight=64
    ).save("eagle3-endpoint", overwrite=True)
    ArtifactStoreBlock(location=str(Path(args.runs_dir).resolve())).save("eagle3-runs", overwrite=True)
    HiddenStateBackendBlock(backend="hf", device="cpu", dtype="bfloat16").save("eagle3-gpu-backend", overwrite=True)
    print("saved demo blocks eagle3-endpoint, eagle3-runs, eagle3-gpu-backend")


if __name__ == "__main__":
    main()
