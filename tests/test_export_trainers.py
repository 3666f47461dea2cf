"""Exports read by the trainers' own code: speculators 0.9.0's `ArrowDataset` and specforge 0.2.0's
`build_offline_eagle3_dataset`, run in a separate virtual environment.

speculators wants transformers <= 5.19 and datasets <= 5.1 (this project runs transformers 5.24), and
specforge pins sglang and torch exactly, so both live in their own venv under the test cache
(`EAGLE3_TEST_CACHE`, default ~/.cache/eagle3-datagen), built once with pip from the package index:
`torch==2.13.0` (the CPU build), `speculators==0.9.0`, `transformers<=5.19`, `datasets<=5.1`, then
`specforge==0.2.0 --no-deps` (its offline reader needs none of its pinned dependencies), and torchvision /
torchaudio removed again (pip resolves builds for another torch, which break `import transformers`).
A script in that venv reads both exports and saves what the readers return; this process compares it with
the run's stored states. `EAGLE3_TRAINER_PYTHON` names an interpreter that already has both (e.g.
`/work/venv-spec/bin/python`); one running this test that imports both is used as is. What the readers' states
*mean* (each trainer's target computation against the model's logits) is `tests/test_export_meaning.py`.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from tasks.export import export_run
from tasks.export.progress import MANIFEST
from tests.test_export import PART_LENGTHS, build_run, manifest_order, post_norm, stored

pytestmark = [pytest.mark.slow, pytest.mark.interop]

CACHE = Path(os.environ.get("EAGLE3_TEST_CACHE", Path.home() / ".cache" / "eagle3-datagen"))
TRAINER_PINS = ["torch==2.13.0", "speculators==0.9.0", "transformers<=5.19", "datasets<=5.1"]
NO_DEPS_PINS = ["specforge==0.2.0"]
REMOVE = ["torchvision", "torchaudio"]

READER_SCRIPT = textwrap.dedent(
    """
    import json, sys
    import torch
    from speculators.train.data import ArrowDataset
    from speculators.train.recovery import SampleUnavailable
    from specforge.data.preprocessing import build_offline_eagle3_dataset

    speculators_dir, specforge_dir, out = sys.argv[1:4]
    manifest = json.load(open(speculators_dir + "/eagle3_export.json"))
    ratio = manifest["trainer"]["train_data_ratio"]
    spec_items, approx = [], []
    for split in ("train", "val"):
        ds = ArrowDataset(4096, speculators_dir, on_missing="raise", train_ratio=ratio, split=split)
        approx += ds.approx_lengths
        for i in range(len(ds)):
            item = ds[i]
            if isinstance(item, SampleUnavailable):
                raise SystemExit(f"speculators marked {split} sample {i} unavailable: {item}")
            spec_items.append(item)
    sf_items = []
    for split in ("train", "eval"):
        sf = build_offline_eagle3_dataset(specforge_dir + "/" + split, max_len=4096)
        sf_items += [(sf.datapaths[i], sf[i]) for i in range(len(sf))]
    torch.save({"speculators": spec_items, "approx_lengths": approx, "specforge": sf_items}, out)
    """
)


def trainer_python() -> Path:
    override = os.environ.get("EAGLE3_TRAINER_PYTHON")
    if override:
        return Path(override)
    if importlib.util.find_spec("speculators") and importlib.util.find_spec("specforge"):
        return Path(sys.executable)
    venv = CACHE / "trainer-readers-venv"
    stamp = venv / "eagle3-stamp.json"
    wanted = json.dumps([TRAINER_PINS, NO_DEPS_PINS, REMOVE])
    python = venv / "bin" / "python"
    if stamp.exists() and stamp.read_text() == wanted and python.exists():
        return python
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
    pip = [str(python), "-m", "pip", "install", "-q"]
    subprocess.run([*pip, *TRAINER_PINS], check=True)
    subprocess.run([*pip, "--no-deps", *NO_DEPS_PINS], check=True)
    subprocess.run([str(python), "-m", "pip", "uninstall", "-q", "-y", *REMOVE], check=True)
    stamp.write_text(wanted)
    return python


def test_trainers_read_our_exports(tmp_path: Path, tiny_model_dir: Path) -> None:
    run = tmp_path / "run"
    build_run(run, tiny_model_dir)
    for fmt in ("speculators", "specforge"):
        stats = export_run(run, fmt, tmp_path / fmt, val_fraction=0.3)
        assert 0 < stats["validation_samples"] < stats["samples"]
    script = tmp_path / "read.py"
    script.write_text(READER_SCRIPT)
    result_path = tmp_path / "read.pt"
    subprocess.run(
        [
            str(trainer_python()),
            str(script),
            str(tmp_path / "speculators"),
            str(tmp_path / "specforge"),
            str(result_path),
        ],
        check=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": ""},
    )
    result = torch.load(result_path, weights_only=False)
    reference = stored(run)
    n = sum(len(v) for v in PART_LENGTHS.values())

    order = manifest_order(tmp_path / "speculators")
    assert len(result["speculators"]) == n and result["approx_lengths"] == [len(reference[s]["ids"]) for s in order]
    for index, item in enumerate(result["speculators"]):
        expected = reference[order[index]]
        assert item["input_ids"].tolist() == expected["ids"]
        assert item["loss_mask"].tolist() == expected["mask"]
        assert torch.equal(item["hidden_states"], expected["aux"])
        assert torch.equal(item["verifier_last_hidden_states"], expected["final"])
        assert item["position_ids"].tolist() == list(range(len(expected["ids"])))

    order = manifest_order(tmp_path / "specforge")
    n_train = n - json.loads((tmp_path / "specforge" / MANIFEST).read_text())["validation"]["samples"]
    assert len(result["specforge"]) == n
    for path, item in result["specforge"]:
        expected = reference[order[int(Path(path).stem.split("_")[1])]]
        assert item["input_ids"][0].tolist() == expected["ids"]
        assert item["loss_mask"][0].tolist() == [*expected["mask"][:-1], 0]
        assert torch.equal(item["hidden_state"][0], expected["aux"])
        assert torch.equal(item["target"][0], post_norm(tiny_model_dir, expected["final"]))
        assert ("/eval/" in path) == (int(Path(path).stem.split("_")[1]) >= n_train)
