"""The `train` stage: an EAGLE-3 drafter trained on a run directory with speculators' own trainer.

`train_run(run_dir, options)`:

1. exports the run's hidden states in speculators' offline layout through the export stage's public entry point
   (`export_run(run_dir, "speculators", <out>/export, ...)`, itself resumable; validation split by prompt);
2. resolves the verifier (the target model directory the states were extracted from, recorded in the
   hidden-states provenance); the export's manifest gives the aux layer ids in speculators' convention
   (`extract_layers` + 1: its id k is the input of decoder layer k, ours the output of layer k), the
   `train_data_ratio` that puts exactly the export's training prompts first, and the draft-vocabulary files
   (`token_freq.pt`, `d2t-N.npy` / `t2d-N.npy` built with speculators' own utility);
3. calls speculators' `train.cli.main` with a `TrainConfig` built from `TrainOptions`, under `cpu_trainer()` when
   no accelerator exists (see `cpu_shim`) and with its fused loss made compilable on a GPU (`fused_loss`),
   capturing the trainer's own metric records;
4. writes `<out>/train_summary.json` (atomically) naming the checkpoint directory, which loads with
   `Eagle3DraftModel.from_pretrained`.

Resumable: speculators' checkpointer resumes from `<out>/checkpoints/<epoch>` (mid-epoch too); a finished
summary whose options and data match is returned as is. A change of an option that defines the drafter's shape or
its data split (`RESTART_FIELDS`) starts over instead of resuming another model's checkpoints, and so does a change
of the run's hidden states (a rerun that added or rebuilt parts: `data_parts`), whose export updates itself.
"""

from __future__ import annotations

import json
import logging
import shutil
import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any
from unittest import mock

from tasks.common.errors import ConfigError
from tasks.common.shards import atomic_write_text, done_parts, fingerprint, part_name, read_provenance
from tasks.train.cpu_shim import accelerator_available, cpu_train_dtype, cpu_trainer
from tasks.train.fused_loss import fused_loss_compilable

SPECULATORS_VERSION = "0.9.0"
SUMMARY_NAME = "train_summary.json"
EXPORT_DIR = "export"
CHECKPOINT_DIR = "checkpoints"
OPTIONS_NAME = "train_options.json"
DATA_KEY = "data_parts"
RESTART_FIELDS = ("draft_vocab_size", "num_layers", "val_fraction", "seed", "verifier_path")
"""Options whose change makes the existing export or checkpoints another model's (`discard_incompatible`)."""


class TrainError(ConfigError):
    """The run directory or the options cannot be trained on."""


@dataclass(frozen=True)
class TrainOptions:
    """What the trainer is asked for; `None` fields take speculators' defaults or the device's choice."""

    epochs: int = 3
    max_steps: int | None = None
    lr: float = 1e-3
    ttt_steps: int = 3
    num_layers: int = 1
    total_seq_len: int = 2048
    val_fraction: float = 0.05
    """share of prompts the export holds out (by prompt hash); the trainer validates on them, evaluate walks them"""
    seed: int = 0
    draft_vocab_size: int | None = 32000
    draft_attn_impl: str | None = None
    loss_implementation: str | None = None
    hidden_states_dtype: str | None = None
    """the trainer's autocast dtype; None: speculators' bf16 with an accelerator, `cpu_train_dtype()` on CPU"""
    checkpoint_freq: float = 1.0
    verifier_path: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def for_device(self) -> TrainOptions:
        """CPU: `sdpa` attention (FlexAttention has no CPU backward), the `eager` loss (the fused one is Triton) and
        bf16 autocast only where the CPU has bf16 instructions; with an accelerator speculators' defaults (flex
        attention, fused loss, bf16)."""
        gpu = accelerator_available()
        return TrainOptions(
            **{
                **asdict(self),
                "draft_attn_impl": self.draft_attn_impl or ("simple_flex_attention" if gpu else "sdpa"),
                "loss_implementation": self.loss_implementation or ("fused" if gpu else "eager"),
                "hidden_states_dtype": self.hidden_states_dtype or (None if gpu else cpu_train_dtype()),
            }
        )


def require_run_dir(run_dir: Path) -> None:
    if not Path(run_dir).is_dir():
        raise TrainError(
            f"run directory {Path(run_dir).resolve()} does not exist on this host (a deployment's run_dir is read "
            "where its worker runs: the docker/compose.yaml workers keep run directories at /runs, e.g. /runs/run)"
        )


def hidden_states_provenance(run_dir: Path) -> dict[str, Any]:
    require_run_dir(run_dir)
    refs = done_parts(Path(run_dir), "hidden_states")
    if not refs:
        raise TrainError(f"{run_dir} has no finished hidden_states parts: run extract first")
    return read_provenance(refs[0].path)


def data_parts(run_dir: Path) -> dict[str, str | None]:
    """The run's finished hidden-states parts and their fingerprints (which cover the tokens they were built
    from): checkpoints trained on other ones belong to another dataset."""
    return {part_name(ref.part): fingerprint(ref) for ref in done_parts(Path(run_dir), "hidden_states")}


def speculators_layer_ids(extract_layers: list[int]) -> list[int]:
    """Our layer id k is the output of decoder layer k (HF hidden_states[k + 1]); speculators' (vLLM's) id is the
    index into HF hidden_states, i.e. the input of layer k. Same tensors, ids shifted by one."""
    return [int(k) + 1 for k in extract_layers]


def resolve_verifier(run_dir: Path, options: TrainOptions) -> tuple[Path, list[int]]:
    prov = hidden_states_provenance(run_dir)
    verifier = Path(options.verifier_path or prov.get("extract_model_path") or "")
    if not (verifier / "config.json").is_file():
        raise TrainError(
            f"verifier {verifier} has no config.json: the drafter needs the target's config, embeddings, final norm "
            "and lm_head (pass --verifier PATH)"
        )
    layers = prov.get("extract_layers")
    if not isinstance(layers, list) or len(layers) != 3:
        raise TrainError(f"{run_dir}/hidden_states provenance has no extract_layers (got {layers!r})")
    return verifier, speculators_layer_ids(layers)


def export_trainer_arguments(export_dir: Path) -> dict[str, Any]:
    """What the export says speculators' trainer must be told (layer ids in its convention, the split ratio that
    puts exactly the export's training rows first); a validation split is required (evaluate reads it)."""
    from tasks.export.progress import MANIFEST

    manifest = json.loads((Path(export_dir) / MANIFEST).read_text())
    args: dict[str, Any] = dict(manifest["trainer"])
    if not manifest["validation"]["samples"] or float(args["train_data_ratio"]) >= 1.0:
        raise TrainError(
            f"the export in {export_dir} holds no validation prompts (validation fraction "
            f"{manifest['validation']['fraction']}): raise it so the trainer can validate and evaluate can measure"
        )
    return args


def checkpoint_dirs(save_path: Path) -> list[Path]:
    """Epoch checkpoints speculators wrote, oldest first (`<save_path>/<epoch>/` with a config.json)."""
    if not save_path.is_dir():
        return []
    found = [p for p in save_path.iterdir() if p.is_dir() and p.name.isdigit() and (p / "config.json").is_file()]
    return sorted(found, key=lambda p: int(p.name))


def latest_checkpoint(out_dir: Path) -> Path:
    found = checkpoint_dirs(Path(out_dir) / CHECKPOINT_DIR)
    if not found:
        raise TrainError(f"{out_dir}/{CHECKPOINT_DIR} holds no finished checkpoint")
    return found[-1]


def build_train_config(
    data_path: Path, save_path: Path, verifier: Path, trainer_args: dict[str, Any], o: TrainOptions
) -> Any:
    from speculators.train.config import TrainConfig

    flat: dict[str, Any] = {
        "speculator_type": "eagle3",
        "seed": o.seed,
        "verifier_name_or_path": str(verifier),
        "num_layers": o.num_layers,
        "target_layer_ids": trainer_args["target_layer_ids"],
        "draft_vocab_size": o.draft_vocab_size,
        "draft_attn_impl": o.draft_attn_impl,
        "full_attention_indices": list(range(o.num_layers)),
        "data_path": str(data_path),
        "total_seq_len": o.total_seq_len,
        "train_data_ratio": trainer_args["train_data_ratio"],
        "num_workers": 0,
        "on_missing": "raise",
        "loss_implementation": o.loss_implementation,
        "hidden_states_dtype": o.hidden_states_dtype,
        "ttt_steps": o.ttt_steps,
        "lr": o.lr,
        "epochs": o.epochs,
        "max_steps": o.max_steps,
        "checkpoint_freq": o.checkpoint_freq,
        "save_path": str(save_path),
        "log_dir": str(save_path.parent / "logs"),
        "log_freq": 1,
        "logger": "",
        **o.extra,
    }
    # The trainer CLI's own resolution path (defaults, backend defaults, validation), minus argv parsing.
    cli = {k: v for k, v in flat.items() if v is not None}
    return TrainConfig.from_sources(cli=cli, argv=["eagle3-datagen", "train", str(data_path)], backend_cli={})


class MetricRecords(logging.Handler):
    """Collects the dicts speculators logs on `speculators.metrics` (train per step, val per epoch)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.train: list[dict[str, Any]] = []
        self.val: list[dict[str, Any]] = []
        self.tokens = 0
        """non-padding tokens trained on (the trainer's profile: tokens_per_s x step_ms per logged step)"""
        self.step_ms: list[float] = []
        """the trainer's profile of each logged step: wall milliseconds from fetch to optimizer step"""

    def emit(self, record: logging.LogRecord) -> None:
        msg = record.msg
        if not isinstance(msg, dict):
            return
        if "train" in msg:
            self.train.append({"global_step": msg.get("global_step"), "epoch": msg.get("epoch"), **msg["train"]})
            profile = msg.get("profile") or {}
            if profile.get("tokens_per_s") and profile.get("step_ms"):
                self.tokens += round(profile["tokens_per_s"] * profile["step_ms"] / 1000)
                self.step_ms.append(float(profile["step_ms"]))
        if "val" in msg:
            self.val.append({"epoch": msg.get("epoch"), **msg["val"]})


@contextmanager
def captured_metrics() -> Iterator[MetricRecords]:
    """speculators' `main` reconfigures its loggers (dictConfig) first; the handler joins right after that."""
    import speculators.train.cli as train_cli

    handler = MetricRecords()
    logger = logging.getLogger("speculators.metrics")
    original = train_cli.setup_metric_logger

    def setup_then_capture(*args: Any, **kwargs: Any) -> Any:
        result = original(*args, **kwargs)
        logger.addHandler(handler)
        return result

    try:
        with mock.patch.object(train_cli, "setup_metric_logger", setup_then_capture):
            yield handler
    finally:
        logger.removeHandler(handler)


def epochs_for_steps(export_dir: Path, o: TrainOptions, train_data_ratio: float) -> int:
    """How many epochs `max_steps` optimizer steps span, counted with speculators' own batch sampler.

    speculators 0.9.0's Trainer ends an epoch at `max_steps` but then starts the next one, which again stops
    after its first step (and checkpoints and validates): `max_steps` alone runs every configured epoch. So the
    epochs are cut to the ones the steps need; the last of them ends at `max_steps` exactly.
    """
    if o.max_steps is None:
        return o.epochs
    from datasets import load_from_disk
    from speculators.train.distributed_batch_sampler import MultipackDistributedBatchSamplerV2

    data = load_from_disk(str(export_dir))
    lengths = list(data.select(range(int(len(data) * train_data_ratio))).with_format(None)["seq_len"])
    sampler = MultipackDistributedBatchSamplerV2(
        batch_max_length=o.total_seq_len, lengths=lengths, num_replicas=1, rank=0, seed=o.seed
    )
    steps, epochs = 0, 0
    while steps < o.max_steps and epochs < o.epochs:
        sampler.set_epoch(epochs)
        per_epoch = len(sampler)
        if per_epoch == 0:
            raise TrainError(f"{export_dir}: the training split yields no batch of {o.total_seq_len} tokens")
        steps += per_epoch
        epochs += 1
    return epochs


def discard_incompatible(out: Path, opts: TrainOptions, data: dict[str, str | None]) -> list[str]:
    """The fields of `RESTART_FIELDS` that differ from what `out` was trained with; when any does, its export,
    checkpoints and summary are removed first. speculators' checkpointer would otherwise resume a drafter of
    another shape (a different draft vocabulary) or one trained on another split, and the export would keep the
    old split; changing the epochs, steps or learning rate still resumes. When only the run's data changed
    (`data_parts`, or not recorded), the checkpoints and summary go and the export stays: it updates itself."""
    recorded: dict[str, Any] | None = None
    for path in (out / OPTIONS_NAME, out / SUMMARY_NAME):
        if path.is_file():
            saved = json.loads(path.read_text())
            recorded = saved.get("options", saved) | {DATA_KEY: saved.get(DATA_KEY)}
            break
    if recorded is None:
        return []
    now = _jsonable(asdict(opts))
    changed = [k for k in RESTART_FIELDS if recorded.get(k) != now.get(k)]
    if changed:
        logging.getLogger(__name__).warning(
            "%s was trained with other %s: starting over (export and checkpoints removed)", out, ", ".join(changed)
        )
        for name in (EXPORT_DIR, CHECKPOINT_DIR):
            shutil.rmtree(out / name, ignore_errors=True)
        (out / SUMMARY_NAME).unlink(missing_ok=True)
    elif recorded.get(DATA_KEY) != data:
        logging.getLogger(__name__).warning(
            "the run's hidden states changed since %s was trained (%d parts now): training starts over on all of "
            "them (checkpoints removed; the export updates itself)",
            out,
            len(data),
        )
        shutil.rmtree(out / CHECKPOINT_DIR, ignore_errors=True)
        (out / SUMMARY_NAME).unlink(missing_ok=True)
        changed = [DATA_KEY]
    return changed


def finished_summary(out: Path, opts: TrainOptions, data: dict[str, str | None]) -> dict[str, Any] | None:
    """The summary of a drafter already trained with these options on this data (`resumed: finished`), if any."""
    path = out / SUMMARY_NAME
    if not path.is_file():
        return None
    previous: dict[str, Any] = json.loads(path.read_text())
    if (
        previous.get("options") != _jsonable(asdict(opts))
        or previous.get(DATA_KEY) != data
        or not Path(previous["checkpoint"]).is_dir()
    ):
        return None
    return previous | {"resumed": "finished"}


def _scalars(record: dict[str, Any]) -> dict[str, Any]:
    return {k: (round(v, 6) if isinstance(v, float) else v) for k, v in record.items() if isinstance(v, int | float)}


def train_run(run_dir: Path, out_dir: Path | None = None, options: TrainOptions | None = None) -> dict[str, Any]:
    """Export (if needed) and train; returns the summary also written to `<out_dir>/train_summary.json`. A run
    directory that is not there, or holds nothing to train on, is refused before anything is written (a UI probe's
    `runs/nope` got a `train/train_options.json`, and then "run extract first" for the directory that made)."""
    from tasks.export import export_run

    run_dir = Path(run_dir).resolve()
    require_run_dir(run_dir)
    out = Path(out_dir or run_dir / "train").resolve()
    opts = (options or TrainOptions()).for_device()
    summary_path = out / SUMMARY_NAME
    data = data_parts(run_dir)
    previous = finished_summary(out, opts, data)
    if previous is not None:
        return previous
    verifier, _ = resolve_verifier(run_dir, opts)
    restarted = discard_incompatible(out, opts, data)
    atomic_write_text(out / OPTIONS_NAME, json.dumps(_jsonable(asdict(opts)) | {DATA_KEY: data}, indent=2))
    started = time.monotonic()
    export_stats = export_run(
        run_dir,
        "speculators",
        out / EXPORT_DIR,
        val_fraction=opts.val_fraction,
        split_seed=opts.seed,
        draft_vocab_size=opts.draft_vocab_size,
        target_model=verifier,
    )
    export_s = time.monotonic() - started
    trainer_args = export_trainer_arguments(out / EXPORT_DIR)
    save_path = out / CHECKPOINT_DIR
    resumed_from = [p.name for p in checkpoint_dirs(save_path)]
    epochs = epochs_for_steps(out / EXPORT_DIR, opts, trainer_args["train_data_ratio"])
    cfg = build_train_config(out / EXPORT_DIR, save_path, verifier, trainer_args, replace(opts, epochs=epochs))
    from speculators.train.cli import main as speculators_train

    train_started = time.monotonic()
    with captured_metrics() as metrics, cpu_trainer(), fused_loss_compilable() as unshared:
        if unshared:
            logging.getLogger(__name__).info("fused loss: backward autotuner's own copy of %s", ", ".join(unshared))
        speculators_train(cfg)
    train_s = time.monotonic() - train_started
    checkpoint = latest_checkpoint(out)
    summary = {
        "run_dir": str(run_dir),
        "out_dir": str(out),
        "checkpoint": str(checkpoint),
        "verifier": str(verifier),
        "target_layer_ids": trainer_args["target_layer_ids"],
        "train_data_ratio": trainer_args["train_data_ratio"],
        "speculators_version": _speculators_version(),
        "device": "accelerator" if accelerator_available() else "cpu",
        "options": _jsonable(asdict(opts)),
        DATA_KEY: data,
        "export": {k: export_stats[k] for k in ("samples", "validation_samples", "parts", "bytes_written", "wall_s")},
        "resumed_from_checkpoints": resumed_from,
        "discarded_for_changed_options": restarted,
        "epochs_run": epochs,
        "steps": len(metrics.train),
        "train_tokens": metrics.tokens,
        "step_ms_median": round(statistics.median(metrics.step_ms), 1) if metrics.step_ms else None,
        "train_metrics": [_scalars(r) for r in metrics.train],
        "val_metrics": [_scalars(r) for r in metrics.val],
        "export_s": round(export_s, 3),
        "train_s": round(train_s, 3),
        "wall_s": round(time.monotonic() - started, 3),
    }
    atomic_write_text(summary_path, json.dumps(summary, indent=2))
    return summary


def _speculators_version() -> str:
    from importlib.metadata import version

    return version("speculators")


def _jsonable(value: Any) -> Any:
    return json.loads(json.dumps(value, default=str))
