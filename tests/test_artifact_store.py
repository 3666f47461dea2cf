from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pytest
import torch

from blocks.artifact_store import ArtifactStoreBlock
from tasks.common.artifact_store import RunStore
from tasks.common.errors import ConfigError
from tasks.common.schemas import HIDDEN_STATES_INDEX, PROMPTS
from tasks.common.shards import PartRef, atomic_write_bytes, read_part, write_part

ROW = {
    "sample_id": "a",
    "dataset": "B1",
    "source_file": "f",
    "source_row": 0,
    "messages": [{"role": "user", "content": "hi"}],
    "prompt_id": "a",
    "sample_index": 0,
}


def test_parts_travel_between_hosts_marker_last(tmp_path: Path) -> None:
    remote = f"file://{tmp_path / 'bucket'}"
    cpu = RunStore(remote, tmp_path / "cpu-host" / "run1")
    gpu = RunStore(remote, tmp_path / "gpu-host" / "run1")
    ref = PartRef(cpu.local_run_dir, "prompts", 0)
    write_part(ref, pa.Table.from_pylist([ROW], schema=PROMPTS), {"model": "m"})
    assert cpu.push_part(ref) == 2
    assert (tmp_path / "bucket" / "run1" / "prompts" / "_done" / "part-00000.json").exists()
    assert not list((tmp_path / "bucket").rglob("*.uploading-*"))

    assert gpu.pull_stage("prompts") == [0]
    assert read_part(PartRef(gpu.local_run_dir, "prompts", 0)).to_pylist() == [ROW]
    assert gpu.pull_stage("prompts") == []


def test_a_part_without_remote_marker_is_invisible(tmp_path: Path) -> None:
    remote = f"file://{tmp_path / 'bucket'}"
    cpu = RunStore(remote, tmp_path / "cpu" / "run1")
    ref = PartRef(cpu.local_run_dir, "prompts", 0)
    write_part(ref, pa.Table.from_pylist([ROW], schema=PROMPTS), {})
    cpu.push_file(ref.path)
    gpu = RunStore(remote, tmp_path / "gpu" / "run1")
    assert gpu.pull_stage("prompts") == []
    ref.marker.unlink()
    with pytest.raises(ConfigError, match="no completion marker"):
        cpu.push_part(ref)


def test_hidden_state_parts_carry_their_safetensors_shards(tmp_path: Path) -> None:
    from safetensors.torch import save

    remote = "memory://eagle3-test-bucket"
    gpu = RunStore(remote, tmp_path / "gpu" / "run1")
    shard = "data/part-00000-0000.safetensors"
    atomic_write_bytes(gpu.local_run_dir / "hidden_states" / shard, save({"x": torch.zeros(2, 2)}))
    index = {
        "sample_id": "a",
        "dataset": "B1",
        "shard": shard,
        "offset": 0,
        "length": 2,
        "layers": [1, 3, 4],
        "hidden_size": 2,
        "dtype": "bfloat16",
    }
    ref = PartRef(gpu.local_run_dir, "hidden_states", 0)
    write_part(ref, pa.Table.from_pylist([index], schema=HIDDEN_STATES_INDEX), {})
    assert gpu.push_part(ref) == 3
    trainer = RunStore(remote, tmp_path / "trainer" / "run1")
    assert trainer.pull_stage("hidden_states") == [0]
    assert (trainer.local_run_dir / "hidden_states" / shard).read_bytes() == (
        gpu.local_run_dir / "hidden_states" / shard
    ).read_bytes()


def test_store_block_mounted_path_needs_no_mirror(tmp_path: Path) -> None:
    mounted = ArtifactStoreBlock(location=str(tmp_path / "runs"))
    assert mounted.run_store("r") is None
    assert mounted.local_run_dir("r") == tmp_path / "runs" / "r"
    remote = ArtifactStoreBlock(location="s3://bucket/eagle3", local_cache_dir=str(tmp_path / "cache"))
    assert remote.local_run_dir("r") == tmp_path / "cache" / "r"
