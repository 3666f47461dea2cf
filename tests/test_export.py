"""Exports of a real extracted run, read back with loaders that follow each trainer's documented reader.

The SpecForge loader below transcribes `list_local_files` and `OfflineEagle3Dataset.process_data` from
specforge 0.2.0 (`specforge/data/preprocessing.py`); the speculators loader transcribes what
`speculators.train.data.ArrowDataset` 0.9.0 does (`datasets.load_from_disk` + `hs_connectors.FileTransfer`),
reading the `save_to_disk` folder with pyarrow the way `datasets` does. The projects' own readers run on the
same exports in tests/test_export_trainers.py (slow: it builds a venv with them).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
import torch
import yaml
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from flows.cli import main
from tasks.common.errors import CaptureMismatchError
from tasks.common.schemas import PROMPTS, TOKENS
from tasks.common.shards import PartRef, read_part, write_part
from tasks.export import ExportError, export_run
from tasks.export.progress import MANIFEST
from tasks.export.split import in_validation
from tasks.extract.hf_backend import HFHiddenStateRunner
from tasks.extract.stage import extract_part
from tasks.extract.storage import HIDDEN_DIR, load_hidden_states
from tests.test_extract import index_rows, loss_mask_for, make_cfg, sample_ids, write_tokens

PART_LENGTHS = {0: [17, 5, 33, 9], 1: [24, 1, 12], 2: []}


def build_run(run_dir: Path, model_dir: Path, *, store_final_state: bool = True) -> dict[str, list[int]]:
    runner = HFHiddenStateRunner.load(
        model_dir, device="cpu", max_tokens_per_batch=64, store_final_state=store_final_state
    )
    cfg = make_cfg(run_dir, model_dir, max_tokens_per_batch=64, store_final_state=store_final_state)
    everything: dict[str, list[int]] = {}
    for part, lengths in PART_LENGTHS.items():
        samples = sample_ids(lengths, seed=40 + part, prefix=f"p{part}-")
        write_tokens(run_dir, samples, part=part)
        extract_part(cfg, part, runner)
        everything |= samples
    return everything


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Path:
    directory = tmp_path_factory.mktemp("run")
    build_run(directory, tiny_model_dir)
    return directory


def stored(run_dir: Path, parts: list[int] | None = None) -> dict[str, dict[str, Any]]:
    """What the run holds, per sample id: the reference every export is compared with."""
    out: dict[str, dict[str, Any]] = {}
    for part in list(PART_LENGTHS) if parts is None else parts:
        masks = {r["sample_id"]: r["loss_mask"] for r in read_part(PartRef(run_dir, "tokens", part)).to_pylist()}
        for row in index_rows(run_dir, part):
            ids, aux, final = load_hidden_states(run_dir, row)
            out[row["sample_id"]] = {"ids": ids.tolist(), "mask": masks[row["sample_id"]], "aux": aux, "final": final}
    return out


def manifest_order(out_dir: Path) -> list[str]:
    """Sample ids by export index (training samples first, then the held-out ones)."""
    manifest = json.loads((out_dir / MANIFEST).read_text())
    by_index = {
        i: sid for part in manifest["parts"] for i, sid in zip(part["indices"], part["sample_ids"], strict=True)
    }
    assert sorted(by_index) == list(range(len(by_index)))
    return [by_index[i] for i in range(len(by_index))]


def post_norm(model_dir: Path, final: torch.Tensor) -> torch.Tensor:
    """The target's own final norm over a stored pre-norm state: what SpecForge's export must hold."""
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=final.dtype, local_files_only=True)
    with torch.no_grad():
        out: torch.Tensor = model.get_decoder().norm(final)
    return out


def specforge_files(path: Path) -> list[str]:
    """specforge 0.2.0 `list_local_files`: walk, keep `.ckpt`/`.ckpt.gz`, sort."""
    found = [os.path.join(root, f) for root, _dirs, files in os.walk(path) for f in files]
    return sorted(f for f in found if f.endswith((".ckpt", ".ckpt.gz")))


def specforge_item(path: str, max_len: int) -> dict[str, torch.Tensor]:
    """specforge 0.2.0 `OfflineEagle3Dataset._open_file` + `process_data`."""
    data = torch.load(path, weights_only=False, mmap=True)
    hidden_state = data["aux_hidden_state"].squeeze(0)[:max_len][None, :]
    target = data["hidden_state"].squeeze(0)[:max_len][None, :]
    input_ids = data["input_ids"][:max_len][None, :]
    loss_mask = data["loss_mask"][:max_len][None, :]
    loss_mask[0, -1] = 0
    return {
        "attention_mask": torch.ones_like(loss_mask, dtype=torch.long),
        "loss_mask": loss_mask,
        "target": target,
        "hidden_state": hidden_state,
        "input_ids": input_ids,
    }


def speculators_rows(path: Path) -> list[dict[str, Any]]:
    """`datasets.load_from_disk`: state.json's data files, each an Arrow stream, in order."""
    state = json.loads((path / "state.json").read_text())
    info = json.loads((path / "dataset_info.json").read_text())
    assert state["_format_type"] == "torch"
    rows: list[dict[str, Any]] = []
    for entry in state["_data_files"]:
        with pa.memory_map(str(path / entry["filename"])) as source:
            table = pa.ipc.open_stream(source).read_all()
        assert json.loads(table.schema.metadata[b"huggingface"])["info"]["features"] == info["features"]
        rows.extend(table.to_pylist())
    return rows


def speculators_item(path: Path, index: int, row: dict[str, Any]) -> dict[str, torch.Tensor]:
    """speculators 0.9.0 `ArrowDataset._get_raw_data` over `FileTransfer(path / "hidden_states")`."""
    loaded = load_file(path / "hidden_states" / f"hs_{index}.safetensors")
    input_ids = torch.tensor(row["input_ids"])
    assert torch.equal(loaded["token_ids"], input_ids), "ArrowDataset would mark this sample unavailable"
    return {
        "hidden_states": loaded["hidden_states"][:, :-1].flatten(1),
        "input_ids": loaded["token_ids"],
        "verifier_last_hidden_states": loaded["hidden_states"][:, -1],
        "loss_mask": torch.tensor(row["loss_mask"]),
    }


def test_specforge_export_reads_back(run_dir: Path, tmp_path: Path, tiny_model_dir: Path) -> None:
    stats = export_run(run_dir, "specforge", tmp_path / "sf", val_fraction=0.3)
    reference = stored(run_dir)
    order = manifest_order(tmp_path / "sf")
    assert stats["samples"] == len(order) == len(reference) == sum(len(v) for v in PART_LENGTHS.values())
    train, held_out = specforge_files(tmp_path / "sf" / "train"), specforge_files(tmp_path / "sf" / "eval")
    assert len(train) + len(held_out) == len(order) and stats["validation_samples"] == len(held_out) > 0
    assert {int(Path(p).stem.split("_")[1]) for p in held_out} == set(range(len(train), len(order)))
    for path in train + held_out:
        index = int(Path(path).stem.split("_")[1])
        expected = reference[order[index]]
        item = specforge_item(path, max_len=2048)
        assert item["input_ids"][0].tolist() == expected["ids"]
        assert item["loss_mask"][0].tolist() == [*expected["mask"][:-1], 0]
        assert item["hidden_state"].dtype == torch.bfloat16 and item["hidden_state"].shape == (
            1,
            len(expected["ids"]),
            192,
        )
        assert torch.equal(item["hidden_state"][0], expected["aux"])
        assert torch.equal(item["target"][0], post_norm(tiny_model_dir, expected["final"]))
        raw = torch.load(path, weights_only=True)
        assert raw["input_ids"].dtype == raw["loss_mask"].dtype == torch.int64
        assert raw["input_ids"].ndim == 1 and raw["aux_hidden_state"].shape[0] == 1


def test_speculators_export_reads_back(run_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "spec"
    export_run(run_dir, "speculators", out, val_fraction=0.3)
    reference = stored(run_dir)
    order = manifest_order(out)
    rows = speculators_rows(out)
    assert [r["seq_len"] for r in rows] == [len(reference[s]["ids"]) for s in order]
    for index, row in enumerate(rows):
        expected = reference[order[index]]
        item = speculators_item(out, index, row)
        assert item["input_ids"].tolist() == expected["ids"] and item["loss_mask"].tolist() == expected["mask"]
        assert item["hidden_states"].dtype == torch.bfloat16
        assert torch.equal(item["hidden_states"], expected["aux"])
        assert torch.equal(item["verifier_last_hidden_states"], expected["final"])
    assert sorted(p.name for p in out.glob("data-*.arrow")) == [
        f"data-0000{part}-{rows}.arrow" for part in range(3) for rows in ("heldout", "train")
    ]
    manifest = json.loads((out / MANIFEST).read_text())
    n_train = len(rows) - manifest["validation"]["samples"]
    assert 0 < n_train < len(rows) and int(len(rows) * manifest["trainer"]["train_data_ratio"]) == n_train
    assert manifest["trainer"]["target_layer_ids"] == [2, 4, 5] and manifest["trainer"]["verifier_final_layer_id"] == 8
    assert manifest["final_state"] == "pre_norm"
    freq = torch.load(out / "token_freq.pt", weights_only=True)
    expected_freq: dict[int, int] = {}
    for sid in order[:n_train]:
        for token, keep in zip(reference[sid]["ids"], reference[sid]["mask"], strict=True):
            if keep:
                expected_freq[token] = expected_freq.get(token, 0) + 1
    assert freq == expected_freq


def test_specforge_sample_files_hold_only_their_own_bytes(run_dir: Path, tmp_path: Path) -> None:
    """A slice of a shard saved as is drags the shard's whole storage into the file (the 16x of issue 13)."""
    export_run(run_dir, "specforge", tmp_path / "sf")
    for path in specforge_files(tmp_path / "sf"):
        record = torch.load(path, weights_only=True)
        data = sum(t.numel() * t.element_size() for t in record.values())
        assert Path(path).stat().st_size <= data + 4096, (path, data)
        for tensor in record.values():
            assert tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size()


def test_validation_split_is_by_prompt(run_dir: Path, tmp_path: Path) -> None:
    """Samples sharing a prompt (from the prompts parts) land on the same side; the split does not depend on
    part order or on which export format is written."""
    run = tmp_path / "run"
    shutil.copytree(run_dir, run)
    sample_ids_all = [sid for part in PART_LENGTHS for sid in (r["sample_id"] for r in index_rows(run, part))]
    prompt_of = {sid: f"prompt-{n % 3}" for n, sid in enumerate(sample_ids_all)}
    rows = [
        {
            "sample_id": sid,
            "dataset": "demo",
            "source_file": "x.jsonl",
            "source_row": n,
            "messages": [{"role": "user", "content": "hi"}],
            "prompt_id": prompt_of[sid],
            "sample_index": 0,
        }
        for n, sid in enumerate(sample_ids_all)
    ]
    write_part(PartRef(run, "prompts", 0), pa.Table.from_pylist(rows, schema=PROMPTS), {"test": True})
    sides: dict[str, set[bool]] = {}
    for fmt in ("speculators", "specforge"):
        export_run(run, fmt, tmp_path / fmt, val_fraction=0.5, split_seed=3)
        manifest = json.loads((tmp_path / fmt / MANIFEST).read_text())
        assert manifest["validation"]["samples_grouped_by_own_id"] == 0
        for part in manifest["parts"]:
            for sid, held in zip(part["sample_ids"], part["validation"], strict=True):
                sides.setdefault(prompt_of[sid], set()).add(held)
                assert held == in_validation(prompt_of[sid], 0.5, 3)
    assert all(len(s) == 1 for s in sides.values()) and {True, False} == {next(iter(s)) for s in sides.values()}


@pytest.mark.parametrize("fmt", ["specforge", "speculators"])
def test_export_resumes_per_part_and_removes_stale_files(run_dir: Path, tmp_path: Path, fmt: str) -> None:
    out = tmp_path / fmt
    first = export_run(run_dir, fmt, out)
    assert first["parts_skipped"] == 0 and first["bytes_written"] > 0
    again = export_run(run_dir, fmt, out)
    assert (again["parts_skipped"], again["bytes_written"]) == (3, 0)
    (out / "_eagle3_export" / "part-00001.json").unlink()
    stale = out / ("train/rows_0-2000/data_999.ckpt" if fmt == "specforge" else "hidden_states/hs_999.safetensors")
    stale.write_bytes(b"left by a bigger export")
    if fmt == "specforge":  # an export from before the train/eval split
        (out / "rows_0-2000").mkdir()
        (out / "rows_0-2000" / "data_0.ckpt").write_bytes(b"unsplit layout")
    third = export_run(run_dir, fmt, out)
    assert third["parts_skipped"] == 2 and third["bytes_written"] > 0
    assert third["stale_files_removed"] == (2 if fmt == "specforge" else 1)
    assert not stale.exists() and (out / MANIFEST).exists()


def test_a_specforge_re_export_with_another_target_norm_rewrites_every_file(
    run_dir: Path, tmp_path: Path, tiny_model_dir: Path
) -> None:
    """SpecForge's files hold `norm(pre_norm)`: exported once with a wrong target (or one fixed in place since),
    then again with the right one into the same directory, every part was skipped (its markers cover only the
    run's parts) and every file kept the wrong norm, while the manifest named the right model."""
    wrong = tmp_path / "wrong-model"
    shutil.copytree(tiny_model_dir, wrong)
    weights = load_file(str(wrong / "model.safetensors"))
    weights["model.norm.weight"] = weights["model.norm.weight"] * 1.5
    save_file(weights, str(wrong / "model.safetensors"), metadata={"format": "pt"})
    out, fresh = tmp_path / "sf", tmp_path / "sf-fresh"
    export_run(run_dir, "specforge", out, target_model=wrong)
    again = export_run(run_dir, "specforge", out, target_model=tiny_model_dir)
    assert again["parts_skipped"] == 0 and again["bytes_written"] > 0
    export_run(run_dir, "specforge", fresh, target_model=tiny_model_dir)
    files = sorted(p.relative_to(fresh) for p in fresh.rglob("data_*.ckpt"))
    assert files and files == sorted(p.relative_to(out) for p in out.rglob("data_*.ckpt"))
    for name in files:
        assert torch.equal(torch.load(out / name)["hidden_state"], torch.load(fresh / name)["hidden_state"])
    assert export_run(run_dir, "specforge", out, target_model=tiny_model_dir)["parts_skipped"] == 3


def test_speculators_export_follows_a_rerun_that_adds_a_part(
    run_dir: Path, tmp_path: Path, tiny_model_dir: Path
) -> None:
    """A part the rerun leaves alone keeps its row files (named by its part, not by the part count, which the
    new part changes); the updated export reads back whole, and the draft-vocabulary files of the old rows (one
    from an earlier `--draft-vocab-size`, one the trainer wrote) are gone while a no-op re-export keeps them."""
    run, out = tmp_path / "run", tmp_path / "spec"
    shutil.copytree(run_dir, run)
    export_run(run, "speculators", out, val_fraction=0.0)
    for name in ("d2t-64.npy", "t2d-64.npy"):
        (out / name).write_bytes(b"a mapping of the old rows")
    assert export_run(run, "speculators", out, val_fraction=0.0)["stale_files_removed"] == 0
    assert (out / "d2t-64.npy").exists()
    runner = HFHiddenStateRunner.load(tiny_model_dir, device="cpu", max_tokens_per_batch=64)
    write_tokens(run, sample_ids([9, 11], seed=50, prefix="p3-"), part=3)
    extract_part(make_cfg(run, tiny_model_dir, max_tokens_per_batch=64), 3, runner)
    stats = export_run(run, "speculators", out, val_fraction=0.0)
    assert "speculators refuses train_data_ratio 1.0" in stats["warnings"][0]
    assert stats["parts_skipped"] == 3 and stats["samples"] == sum(map(len, PART_LENGTHS.values())) + 2
    assert stats["stale_files_removed"] == 2 and not list(out.glob("*-64.npy"))
    reference = stored(run, [*PART_LENGTHS, 3])
    order = manifest_order(out)
    rows = speculators_rows(out)
    assert len(rows) == len(order) == len(reference)
    for index, row in enumerate(rows):
        item = speculators_item(out, index, row)
        assert item["input_ids"].tolist() == reference[order[index]]["ids"]
        assert torch.equal(item["verifier_last_hidden_states"], reference[order[index]]["final"])


def test_specforge_config_reads_a_tied_head_and_names_the_missing_index(
    run_dir: Path, tmp_path: Path, tiny_model_dir: Path
) -> None:
    """The tiny target ties its lm_head to its embedding and is one safetensors file: SpecForge 0.2.0's
    `TargetHead` looks `model.lm_head_key` up in a `*.index.json`, so the config names the embedding's key; the
    project's own targets carry that index, and a one-file target without it gets a warning saying which index
    to write."""
    assert export_run(run_dir, "specforge", tmp_path / "own", val_fraction=0.3)["warnings"] == []
    bare = tmp_path / "bare-target"
    shutil.copytree(tiny_model_dir, bare)
    (bare / "model.safetensors.index.json").unlink()
    out = tmp_path / "sf"
    stats = export_run(run_dir, "specforge", out, val_fraction=0.3, target_model=bare)
    text = (out / "specforge_config.yaml").read_text()
    config = yaml.safe_load(text)
    assert config["model"] == {
        "target_model_path": str(bare.resolve()),
        "aux_hidden_state_layer_ids": [1, 3, 4],
        "torch_dtype": "bfloat16",
        "lm_head_key": "model.embed_tokens.weight",
        "embedding_key": "model.embed_tokens.weight",
    }
    assert config["data"] == {
        "hidden_states_path": str(out.resolve() / "train"),
        "max_length": 2048,
        "eval_hidden_states_path": str(out.resolve() / "eval"),
    }
    assert config["training"]["eval_interval"] > 0
    [warning] = stats["warnings"]
    assert "lm_head (model.embed_tokens.weight)" in warning and "mapping every tensor of model.safetensors" in warning
    assert f"# WARNING: {warning}" in text and json.loads((out / MANIFEST).read_text())["warnings"] == [warning]


def test_aux_only_runs_are_refused(tmp_path: Path, tiny_model_dir: Path) -> None:
    build_run(tmp_path / "run", tiny_model_dir, store_final_state=False)
    for fmt in ("specforge", "speculators"):
        with pytest.raises(ExportError, match="aux states only"):
            export_run(tmp_path / "run", fmt, tmp_path / fmt)


def test_states_that_do_not_match_their_tokens_are_refused(tmp_path: Path, tiny_model_dir: Path) -> None:
    run = tmp_path / "run"
    samples = build_run(run, tiny_model_dir)
    tampered = {sid: ids for sid, ids in samples.items() if sid.startswith("p1-")}
    tampered["p1-01"] = [tampered["p1-01"][0] + 1]
    n = len(tampered)
    table = pa.table(
        {
            "sample_id": list(tampered),
            "dataset": ["demo"] * n,
            "input_ids": list(tampered.values()),
            "loss_mask": [loss_mask_for(ids) for ids in tampered.values()],
            "prompt_len": [0] * n,
            "completion_len": [len(ids) for ids in tampered.values()],
            "reasoning_len": [0] * n,
            "completion_format": ["test"] * n,
            "token_source": ["reencoded"] * n,
        },
        schema=TOKENS,
    )
    write_part(PartRef(run, "tokens", 1), table, {"test": True})
    with pytest.raises(ExportError, match="sample p1-01: stored input ids differ"):
        export_run(run, "speculators", tmp_path / "out")
    assert not (tmp_path / "out" / MANIFEST).exists()


def test_corrupted_states_are_refused_naming_the_sample(run_dir: Path, tmp_path: Path) -> None:
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    row = index_rows(copy, 0)[2]
    shard = copy / HIDDEN_DIR / row["shard"]
    tensors = load_file(shard)
    with safe_open(str(shard), framework="pt") as fh:
        metadata = fh.metadata()
    tensors["hidden_states"][row["offset"] + 1, 3] = float("nan")
    save_file(tensors, shard, metadata=metadata)
    with pytest.raises(CaptureMismatchError, match="NaN/Inf") as err:
        export_run(copy, "specforge", tmp_path / "out")
    assert err.value.sample_id == row["sample_id"]


def test_foreign_output_directories_are_refused(run_dir: Path, tmp_path: Path) -> None:
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("mine")
    with pytest.raises(ExportError, match="not empty"):
        export_run(run_dir, "specforge", tmp_path / "busy")
    export_run(run_dir, "specforge", tmp_path / "sf")
    with pytest.raises(ExportError, match="holds a specforge export"):
        export_run(run_dir, "speculators", tmp_path / "sf")
    with pytest.raises(ExportError, match="not one of"):
        export_run(run_dir, "medusa", tmp_path / "x")
    with pytest.raises(ExportError, match="no finished hidden_states parts"):
        export_run(tmp_path / "empty", "specforge", tmp_path / "y")


def test_cli_export(run_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["export", str(run_dir), "--format", "speculators", "--out", str(tmp_path / "cli")]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert stats["format"] == "speculators" and stats["samples"] == 7
    assert (tmp_path / "cli" / "state.json").exists()


@pytest.mark.parametrize(("fmt", "package"), [("speculators", "speculators"), ("specforge", "specforge")])
def test_draft_vocabulary_needs_the_trainers_own_utility(run_dir: Path, tmp_path: Path, fmt: str, package: str) -> None:
    """Without the trainer installed, a draft vocabulary is refused with what to do instead (the meaning tests
    cover the files written where it is installed)."""
    import importlib.util

    if importlib.util.find_spec(package) is not None:
        pytest.skip(f"{package} is installed here")
    with pytest.raises(ExportError, match=f"{package} is not installed here"):
        export_run(run_dir, fmt, tmp_path / fmt, draft_vocab_size=64)
    with pytest.raises(ExportError, match="validation fraction"):
        export_run(run_dir, fmt, tmp_path / "x", val_fraction=1.0)
