"""Hidden-state capture with transformers: the target model runs once per batch and only the tensors the
drafter needs leave it.

Forward hooks on the configured decoder layers (and a forward-pre-hook on the final norm, unless only aux states
are stored: the final state kept is the norm's *input*, `storage.FINAL_STATE`) copy each layer's unpadded rows
into one preallocated per-batch buffer as the layer finishes, so no layer
output outlives its hook and `output_hidden_states` (every layer kept) is never requested. The base model
(`get_decoder()`) runs instead of the CausalLM, so no lm_head logits ([T, vocab], by far the largest
activation) are computed. Batches are planned by a padded-token budget over length-sorted samples, longest
first, so an out-of-memory budget fails on the first batch rather than hours in.

Rows are gathered with index tensors prepared on the host, never with boolean masks, because a boolean index
makes the host wait for the device: with index gathers the next batch's kernels are queued while this batch's
rows are still being copied to the host (`capture.HostStager`).

`device_map` hands placement to accelerate (layers spread over the visible GPUs, for models larger than one);
inputs then go to the embedding's device and the buffers live where the final norm runs.

Scoring (`score_from` given): the decoder's own normed output, the lm_head's input, is scored in the same pass
for the answer tokens only (`score_head.ScoreHead.score_normed`: chunked logits on the device, one float and
one bool per token kept), and the scores travel to the host with the states.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
import transformers
from torch import nn
from transformers import AutoModelForCausalLM, PreTrainedModel

from tasks.common.errors import ConfigError
from tasks.extract.capture import CapturedBatch, plan_padded_batches
from tasks.extract.devices import module_device
from tasks.extract.layers import resolve_layers
from tasks.extract.score_head import ScoreHead, plan_token_scores
from tasks.extract.storage import DTYPES, FINAL_STATE, NO_FINAL_STATE, StateLayout, dtype_name
from tasks.extract.writer import TokenScores

if TYPE_CHECKING:
    from tasks.common.config import PipelineConfig


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as exc:
        raise ConfigError(f"extract.device {name!r} is not a torch device: {exc}") from exc
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"extract.device {name!r} requested but CUDA is not available")
    return device


def _tensor_output(output: Any) -> torch.Tensor:
    """Decoder layers return a tensor in transformers 5, a tuple (hidden, ...) in older or remote code."""
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, tuple) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    raise ConfigError(f"cannot read a hidden state from a module output of type {type(output).__name__}")


def _norm_input(args: Any, kwargs: dict[str, Any]) -> torch.Tensor:
    """The final norm's input: its first positional argument, or `hidden_states=` (transformers' norms take one)."""
    if args and isinstance(args[0], torch.Tensor):
        return args[0]
    hidden = kwargs.get("hidden_states")
    if isinstance(hidden, torch.Tensor):
        return hidden
    raise ConfigError("the final norm was called without a hidden-state tensor; cannot capture its input")


class HFHiddenStateRunner:
    """A target model with hooks capturing aux (and final) states per batch; build it with `load` or
    `from_config`, or wrap an already built model (benchmarks, tests) with the constructor."""

    backend = "hf"
    scores_in_pass = True

    def __init__(
        self,
        model: PreTrainedModel,
        *,
        model_path: Path,
        layers: Sequence[int] | None = None,
        max_tokens_per_batch: int = 8192,
        store_final_state: bool = True,
        device_map: str | None = None,
    ) -> None:
        self.model_path = Path(model_path)
        self.dtype = model.dtype
        self.dtype_name = dtype_name(self.dtype)
        self.max_tokens_per_batch = max_tokens_per_batch
        self.store_final_state = store_final_state
        self.device_map = device_map
        model.eval()
        self._model = model
        text_config = model.config.get_text_config()
        self.num_layers = int(text_config.num_hidden_layers)
        self.hidden_size = int(text_config.hidden_size)
        self.layers = resolve_layers(layers, self.num_layers)
        pad = getattr(text_config, "pad_token_id", None)
        self._pad_id = pad if isinstance(pad, int) else 0
        self.decoder: nn.Module = model.get_decoder()
        decoder_layers = getattr(self.decoder, "layers", None)
        norm = getattr(self.decoder, "norm", None)
        if not isinstance(decoder_layers, nn.ModuleList) or not isinstance(norm, nn.Module):
            raise ConfigError(
                f"{type(self.decoder).__name__} has no `layers` ModuleList and `norm` module; "
                "the hf backend cannot hook it"
            )
        if len(decoder_layers) != self.num_layers:
            raise ConfigError(f"config says {self.num_layers} layers, the decoder holds {len(decoder_layers)}")
        embeddings = model.get_input_embeddings()
        self.input_device = module_device(embeddings, torch.device("cpu"))
        self.capture_device = module_device(norm, self.input_device)
        self.layout = StateLayout(tuple(self.layers), self.hidden_size, self.dtype, store_final_state)
        self._capturing = True
        self._keep: dict[torch.device, torch.Tensor] = {}
        self._rows = 0
        self._aux: torch.Tensor | None = None
        self._final: torch.Tensor | None = None
        self._filled: set[str] = set()
        self._hooks = [
            decoder_layers[k].register_forward_hook(self._hook(f"layer{k}", slot)) for slot, k in enumerate(self.layers)
        ]
        if store_final_state:
            final_hook = self._hook("final", None)
            self._hooks.append(
                norm.register_forward_pre_hook(
                    lambda module, args, kwargs: final_hook(module, args, _norm_input(args, kwargs)),
                    with_kwargs=True,
                )
            )
        self._scoring: tuple[Sequence[int], int] | None = None
        self.forward_passes = 0

    @classmethod
    def load(
        cls,
        model_path: Path,
        *,
        layers: Sequence[int] | None = None,
        dtype: str = "bfloat16",
        device: str = "auto",
        device_map: str | None = None,
        max_tokens_per_batch: int = 8192,
        store_final_state: bool = True,
    ) -> HFHiddenStateRunner:
        if dtype not in DTYPES:
            raise ConfigError(f"extract.dtype {dtype!r} not one of {sorted(DTYPES)}")
        if not Path(model_path).is_dir():
            raise ConfigError(f"extract model path {model_path} is not a local directory")
        if device_map is not None and device != "auto":
            raise ConfigError(f"extract.device_map {device_map!r} places the model itself; leave extract.device auto")
        if device_map is None:
            target = resolve_device(device)
            model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=DTYPES[dtype], local_files_only=True)
            cast(nn.Module, model).to(target)
        else:
            model = AutoModelForCausalLM.from_pretrained(
                str(model_path), dtype=DTYPES[dtype], device_map=device_map, local_files_only=True
            )
        return cls(
            model,
            model_path=Path(model_path),
            layers=layers,
            max_tokens_per_batch=max_tokens_per_batch,
            store_final_state=store_final_state,
            device_map=device_map,
        )

    @classmethod
    def from_config(cls, cfg: PipelineConfig) -> HFHiddenStateRunner:
        return cls.load(
            cfg.extract_model_path,
            layers=cfg.extract.layers,
            dtype=cfg.extract.dtype,
            device=cfg.extract.device,
            device_map=cfg.extract.device_map,
            max_tokens_per_batch=cfg.extract.max_tokens_per_batch,
            store_final_state=cfg.extract.store_final_state,
        )

    def _hook(self, key: str, slot: int | None) -> Callable[[nn.Module, Any, Any], None]:
        width = self.hidden_size

        def capture(module: nn.Module, args: Any, output: Any) -> None:
            if not self._capturing:
                return
            hidden = _tensor_output(output)
            flat = hidden.reshape(-1, width)
            keep = self._keep.get(flat.device)
            if keep is None:
                keep = self._keep[flat.device] = self._keep[torch.device("cpu")].to(flat.device, non_blocking=True)
            rows = flat if keep.numel() == flat.shape[0] else flat.index_select(0, keep)
            if slot is None:
                if self._final is None:
                    raise ConfigError("final-state hook fired without a batch buffer")
                self._final.copy_(rows, non_blocking=True)
            else:
                if self._aux is None:
                    raise ConfigError("aux hook fired without a batch buffer")
                self._aux[:, slot * width : (slot + 1) * width].copy_(rows, non_blocking=True)
            self._filled.add(key)

        return capture

    @cached_property
    def score_head(self) -> ScoreHead:
        """The model's own final norm and lm_head (built on first use: a model without an lm_head still extracts)."""
        return ScoreHead.from_model(self._model)

    @contextmanager
    def hooks_paused(self) -> Iterator[None]:
        """Run the decoder without capturing (the benchmark's raw-forward reference)."""
        self._capturing = False
        try:
            yield
        finally:
            self._capturing = True

    def provenance(self) -> dict[str, Any]:
        return {
            "extract_backend": self.backend,
            "extract_model_path": str(self.model_path),
            "extract_layers": list(self.layers),
            "extract_dtype": self.dtype_name,
            "extract_num_layers": self.num_layers,
            "extract_hidden_size": self.hidden_size,
            "extract_device": str(self.input_device),
            "extract_device_map": self.device_map,
            "extract_store_final_state": self.store_final_state,
            "extract_final_state": FINAL_STATE if self.store_final_state else NO_FINAL_STATE,
            "torch_version": torch.__version__,
            "transformers_version": transformers.__version__,
        }

    def pad_batch(self, sequences: Sequence[Sequence[int]]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Right-padded input ids and attention mask on the input device; no mask when nothing is padded.

        Neither costs the host a wait on the device: the copies leave pinned memory asynchronously (a plain
        `.to(cuda)` waits for the stream, i.e. for the previous batch's forward to finish), and an unpadded
        batch passes no mask, since transformers reads a mask's values on the host to decide whether it can
        use SDPA's causal kernel (another wait, for a mask of all ones that means "causal" anyway).
        """
        width = max((len(s) for s in sequences), default=0)
        ids = torch.full((len(sequences), width), self._pad_id, dtype=torch.long)
        mask = torch.zeros((len(sequences), width), dtype=torch.long)
        for row, seq in enumerate(sequences):
            ids[row, : len(seq)] = torch.as_tensor(seq, dtype=torch.long)
            mask[row, : len(seq)] = 1
        padded = any(len(s) != width for s in sequences)
        if self.input_device.type == "cuda":
            ids, mask = ids.pin_memory(), mask.pin_memory()
        ids = ids.to(self.input_device, non_blocking=True)
        return ids, mask.to(self.input_device, non_blocking=True) if padded else None

    def run_batch(
        self,
        sequences: Sequence[Sequence[int]],
        indices: Sequence[int],
        score_from: Sequence[int] | None = None,
        chunk_tokens: int = 512,
    ) -> CapturedBatch:
        """One right-padded forward pass; the batch's rows, unpadded and in `indices` order, on the device; with
        `score_from` (per sample, the first answer position) also the answer tokens' scores."""
        lengths = [len(s) for s in sequences]
        width = max(lengths, default=0)
        rows = sum(lengths)
        layout = self.layout
        aux = torch.empty(rows, layout.aux_width, dtype=self.dtype, device=self.capture_device)
        final = (
            torch.empty(rows, self.hidden_size, dtype=self.dtype, device=self.capture_device)
            if self.store_final_state
            else None
        )
        if rows == 0:
            return CapturedBatch(list(indices), lengths, aux, final, 0)
        positions = torch.arange(width)
        keep = (positions[None, :] < torch.tensor(lengths)[:, None]).reshape(-1).nonzero().squeeze(1)
        self._keep = {torch.device("cpu"): keep}
        self._aux, self._final = aux, final
        self._filled.clear()
        scores = None
        try:
            ids, mask = self.pad_batch(sequences)
            with torch.inference_mode():
                out = self.decoder(input_ids=ids, attention_mask=mask, use_cache=False)
                if score_from is not None:
                    scores = self._score(out, sequences, score_from, width, chunk_tokens)
            self.forward_passes += 1
            expected = {f"layer{k}" for k in self.layers} | ({"final"} if self.store_final_state else set())
            missing = sorted(expected - self._filled)
            if missing:
                raise ConfigError(f"forward pass did not reach hooked modules {missing}")
        finally:
            self._aux = self._final = None
            self._keep = {}
        return CapturedBatch(list(indices), lengths, aux, final, len(sequences) * width, scores)

    def _score(
        self, out: Any, sequences: Sequence[Sequence[int]], score_from: Sequence[int], width: int, chunk_tokens: int
    ) -> TokenScores:
        normed = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
        rows, targets, counts = plan_token_scores(
            [list(s) for s in sequences],
            list(score_from),
            [n * width for n in range(len(sequences))],
            pin=self.score_head.device.type == "cuda",
        )
        logprobs, top1 = self.score_head.score_normed(normed.reshape(-1, self.hidden_size), rows, targets, chunk_tokens)
        device = self.capture_device
        return TokenScores(logprobs.to(device, non_blocking=True), top1.to(device, non_blocking=True), counts)

    def plan_batches(self, lengths: Sequence[int]) -> list[list[int]]:
        return plan_padded_batches(lengths, self.max_tokens_per_batch)

    @contextmanager
    def scoring(self, score_from: Sequence[int], chunk_tokens: int) -> Iterator[None]:
        """While open, `iter_captures` also scores each sample's tokens from position `score_from[i]` on (the
        indices of the sequences it is given)."""
        self._scoring = (score_from, chunk_tokens)
        try:
            yield
        finally:
            self._scoring = None

    def iter_captures(
        self, sequences: Sequence[Sequence[int]], batches: Sequence[Sequence[int]]
    ) -> Iterator[CapturedBatch]:
        """Yield batch by batch (kernels possibly still running) so the caller can overlap copies and writes."""
        for batch in batches:
            rows = [sequences[i] for i in batch]
            if self._scoring is None:
                yield self.run_batch(rows, batch)
            else:
                score_from, chunk_tokens = self._scoring
                yield self.run_batch(rows, batch, [score_from[i] for i in batch], chunk_tokens)

    def close(self) -> None:
        """Remove the hooks and drop the model, so a long-lived process can free accelerator memory."""
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
        self.__dict__.pop("score_head", None)
        del self._model
        del self.decoder
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
