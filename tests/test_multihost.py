"""The multi-host path, run rather than described: two CPU workers and the GPU-pool worker, each a "host" with
its own local cache directory, sharing only a Prefect server and an S3 server (moto) on loopback. One CPU host is
killed (SIGKILL, with its flow run) mid-run, after generate pushed its parts; a rerun of the same deployment
completes from the store on another host, without sending any sample again and with every sample once."""

from __future__ import annotations

import io
import time
from typing import Any

import pyarrow.parquet as pq

from tasks.common.schemas import STAGES
from tests.conftest import DEMO_DATA
from tests.prefect_cluster import BUCKET, Cluster, dump, s3_fs

RUN = "multihost"


def _remote_ids(fs: Any, stage: str) -> list[str]:
    """sample_ids of every finished part of a stage in the store (marker present), duplicates kept."""
    ids: list[str] = []
    for marker in fs.glob(f"{BUCKET}/runs/{RUN}/{stage}/_done/part-*.json"):
        name = marker.rsplit("/", 1)[1].replace(".json", ".parquet")
        with fs.open(f"{BUCKET}/runs/{RUN}/{stage}/{name}", "rb") as fh:
            ids += pq.read_table(io.BytesIO(fh.read()), columns=["sample_id"])["sample_id"].to_pylist()
    return ids


def _markers(fs: Any, stage: str) -> int:
    fs.invalidate_cache()
    return len(fs.glob(f"{BUCKET}/runs/{RUN}/{stage}/_done/part-*.json"))


def test_a_killed_cpu_host_loses_nothing_and_the_rerun_completes_from_the_store(deployed_cluster: Cluster) -> None:
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from blocks import ArtifactStoreBlock, InferenceEndpointBlock

    c = deployed_cluster
    with temporary_settings({PREFECT_API_URL: c.url}):
        InferenceEndpointBlock(kind="sglang_generate", base_url=c.sim_url, model="sim/tiny").save(
            "eagle3-endpoint", overwrite=True
        )
        ArtifactStoreBlock(location=f"s3://{BUCKET}/runs").save("eagle3-runs", overwrite=True)  # no local_cache_dir
    c.sim("POST", "/_sim/config", json={"unavailable_probes": 0, "noncanonical_rate": 0.1})
    c.sim("POST", "/_sim/reset")
    shipped = c.api("GET", "/deployments/name/eagle3-pipeline/pipeline")["parameters"]["run"]
    small = {  # lean: 12 samples in 2 parts are enough to kill a host between parts of the pipeline
        "run_dir": RUN,
        "samples_per_shard": 6,
        "datasets": [{"name": "B1", "path": str(DEMO_DATA / "demo_b1.jsonl"), "max_samples": 12}],
    }
    params = {"run": {**shipped, "overrides": small}}

    first = c.trigger("eagle3-pipeline/pipeline", params)
    fs = s3_fs(c)
    deadline = time.monotonic() + 300
    while True:  # generate has pushed every responses part: the run is past its only paid stage
        parts = _markers(fs, "prompts")
        if parts and _markers(fs, "responses") == parts:
            break
        state = c.api("GET", f"/flow_runs/{first['id']}")["state"]["type"]
        assert state not in ("COMPLETED", "FAILED", "CRASHED") and time.monotonic() < deadline, dump(c)
        time.sleep(0.2)
    running_on = [h for h in ("cpu-a", "cpu-b") if (c.cache(h) / RUN / "responses").is_dir()]
    assert len(running_on) == 1, running_on
    victim = running_on[0]
    c.kill_host(victim)
    killed = c.api("GET", f"/flow_runs/{first['id']}")
    assert killed["state"]["type"] != "COMPLETED", "the kill must land mid-run"
    assert _markers(fs, "hidden_states") == 0
    sent_before_rerun = c.sim("GET", "/_sim/stats?keys=0")["total_requests"]
    c.api(  # what a user does with a run whose host died: mark it crashed, press Run again
        "POST",
        f"/flow_runs/{first['id']}/set_state",
        json={"state": {"type": "CRASHED", "message": f"host {victim} killed by the test"}, "force": True},
    )

    c.run_to_completion("eagle3-pipeline/pipeline", params)
    survivor = "cpu-b" if victim == "cpu-a" else "cpu-a"
    assert (c.cache(survivor) / RUN / "responses").is_dir(), "the rerun ran on the surviving host, from the store"
    assert (c.cache("gpu") / RUN / "hidden_states").is_dir(), "extraction ran on the GPU host"

    stats = c.sim("GET", "/_sim/stats?keys=0")
    responses = _remote_ids(fs, "responses")
    assert stats["total_requests"] == sent_before_rerun == len(responses), "the rerun sent a sample again"
    for stage in STAGES:
        assert _markers(fs, stage) == parts, stage
        ids = _remote_ids(fs, stage)
        assert len(ids) == len(set(ids)), f"{stage}: a sample is stored twice"
        if stage != "hidden_states":  # extraction skips samples that failed validation
            assert set(ids) == set(responses), f"{stage}: samples lost"
    assert set(_remote_ids(fs, "hidden_states")) <= set(responses)

    c.start_worker("eagle3-cpu", "cpu-c")  # the host comes back (fresh disk) for the tests after this one
