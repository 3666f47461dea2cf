"""Point the `eagle3-runs` block at a shared run store (an fsspec URL: s3://bucket/prefix, gs://...), once this
host has shown it can use it with the credentials in its environment: the bucket exists (created when missing),
and an object can be written and deleted under the prefix. deployments/setup.sh runs it when EAGLE3_STORE_URL is
set; every worker host then needs the same credentials in its environment.

    AWS_ACCESS_KEY_ID=... AWS_SECRET_ACCESS_KEY=... [AWS_ENDPOINT_URL=http://minio:9000] \\
        python deployments/store_block.py s3://eagle3/runs
"""

from __future__ import annotations

import argparse
import sys
import uuid

import fsspec

from blocks import ArtifactStoreBlock
from blocks.artifact_store import is_url


def check_store(url: str) -> str:
    """Create the bucket if it is missing, then write and delete one object under the prefix; returns the bucket."""
    fs, root = fsspec.core.url_to_fs(url)
    bucket = root.strip("/").split("/")[0]
    if not fs.exists(bucket):
        fs.mkdir(bucket)
    probe = f"{root.rstrip('/')}/.eagle3-write-check-{uuid.uuid4().hex[:8]}"
    fs.pipe_file(probe, b"ok")
    fs.rm(probe)
    return bucket


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("url", help="the store, e.g. s3://eagle3/runs (each run is a folder under it)")
    parser.add_argument("--block", default="eagle3-runs", help="the ArtifactStoreBlock name the deployments use")
    parser.add_argument(
        "--local-cache-dir", help="working copies on each host (default: EAGLE3_DATAGEN_CACHE_DIR, else ~/.cache)"
    )
    args = parser.parse_args(argv)
    if not is_url(args.url):
        print(f"{args.url} is not a store URL (s3://bucket/prefix); a shared mount needs no store", file=sys.stderr)
        return 2
    try:
        bucket = check_store(args.url)
    except Exception as exc:  # credentials, endpoint, permissions: one line saying which
        print(f"cannot use {args.url} from this host: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    ArtifactStoreBlock(location=args.url, local_cache_dir=args.local_cache_dir).save(args.block, overwrite=True)
    print(f"saved block {args.block}: {args.url} (bucket {bucket} exists and is writable from this host)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
