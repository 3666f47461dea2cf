"""Hidden-state capture with transformers: the target model runs once per batch and only the tensors the
drafter needs leave it.

Forward hooks on the configured decoder layers and on the final norm collect exactly four tensors per batch;
the base model (`get_decoder()`) runs instead of the CausalLM, so no lm_head logits ([T, vocab], by far the
largest activation) are ever computed, and `output_hidden_states` is not requested, so the other N - 3 layer
outputs are never kept. Batches are packed by a padded-token budget over length-sorted samples, longest first,
so an out-of-memory budget fails on the first batch rather than hours in.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
import transformers
from torch import nn
from transformers import AutoModelForCausalLM

from tasks.errors import ConfigError
from tasks.extract.layers import resolve_layers
from tasks.extract.storage import DTYPES

if TYPE_CHECKING:
    from tasks.config import PipelineConfig


@dataclass(frozen=True)
class CapturedStates:
    """One sample's states, unpadded, on CPU: `aux` [T, 3H] (layers concatenated in order), `final` [T, H]."""

    aux: torch.Tensor
    final: torch.Tensor


@dataclass(frozen=True)
class CapturedBatch:
    """States of one forward pass; `indices` are positions in the sequence list given to `iter_captures`."""

    indices: list[int]
    states: list[CapturedStates]
    padded_tokens: int


def plan_batches(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Pack sample indices longest first while batch_size x longest <= max_tokens (padded tokens).

    A sample longer than the budget still runs, alone: it cannot be split without changing its states.
    """
    if max_tokens < 1:
        raise ConfigError(f"extract.max_tokens_per_batch must be >= 1, got {max_tokens}")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    batches: list[list[int]] = []
    current: list[int] = []
    width = 0
    for i in order:
        if current and (len(current) + 1) * width > max_tokens:
            batches.append(current)
            current = []
        if not current:
            width = lengths[i]
        current.append(i)
    if current:
        batches.append(current)
    return batches


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


class HFHiddenStateRunner:
    """A target model loaded from a local directory, with hooks capturing aux and final states per batch."""

    backend = "hf"

    def __init__(
        self,
        model_path: Path,
        *,
        layers: Sequence[int] | None = None,
        dtype: str = "bfloat16",
        device: str = "auto",
        max_tokens_per_batch: int = 8192,
    ) -> None:
        if dtype not in DTYPES:
            raise ConfigError(f"extract.dtype {dtype!r} not one of {sorted(DTYPES)}")
        if not Path(model_path).is_dir():
            raise ConfigError(f"extract model path {model_path} is not a local directory")
        self.model_path = Path(model_path)
        self.dtype_name = dtype
        self.dtype = DTYPES[dtype]
        self.device = resolve_device(device)
        self.max_tokens_per_batch = max_tokens_per_batch
        model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=self.dtype, local_files_only=True)
        cast(nn.Module, model).to(self.device)
        model.eval()
        self._model = model
        text_config = model.config.get_text_config()
        self.num_layers = int(text_config.num_hidden_layers)
        self.hidden_size = int(text_config.hidden_size)
        self.layers = resolve_layers(layers, self.num_layers)
        pad = getattr(text_config, "pad_token_id", None)
        self._pad_id = pad if isinstance(pad, int) else 0
        self._decoder: nn.Module = model.get_decoder()
        decoder_layers = getattr(self._decoder, "layers", None)
        norm = getattr(self._decoder, "norm", None)
        if not isinstance(decoder_layers, nn.ModuleList) or not isinstance(norm, nn.Module):
            raise ConfigError(
                f"{type(self._decoder).__name__} has no `layers` ModuleList and `norm` module; "
                "the hf backend cannot hook it"
            )
        if len(decoder_layers) != self.num_layers:
            raise ConfigError(f"config says {self.num_layers} layers, the decoder holds {len(decoder_layers)}")
        self._captured: dict[str, torch.Tensor] = {}
        self._aux_keys = [f"layer{k}" for k in self.layers]
        self._hooks = [
            decoder_layers[k].register_forward_hook(self._hook(key))
            for k, key in zip(self.layers, self._aux_keys, strict=True)
        ]
        self._hooks.append(norm.register_forward_hook(self._hook("final")))
        self.forward_passes = 0

    @classmethod
    def from_config(cls, cfg: PipelineConfig) -> HFHiddenStateRunner:
        return cls(
            cfg.extract_model_path,
            layers=cfg.extract.layers,
            dtype=cfg.extract.dtype,
            device=cfg.extract.device,
            max_tokens_per_batch=cfg.extract.max_tokens_per_batch,
        )

    def _hook(self, key: str) -> Callable[[nn.Module, Any, Any], None]:
        def capture(module: nn.Module, args: Any, output: Any) -> None:
            self._captured[key] = _tensor_output(output)

        return capture

    def provenance(self) -> dict[str, Any]:
        return {
            "extract_backend": self.backend,
            "extract_model_path": str(self.model_path),
            "extract_layers": list(self.layers),
            "extract_dtype": self.dtype_name,
            "extract_num_layers": self.num_layers,
            "extract_hidden_size": self.hidden_size,
            "extract_device": str(self.device),
            "torch_version": torch.__version__,
            "transformers_version": transformers.__version__,
        }

    def _empty(self) -> CapturedStates:
        return CapturedStates(
            aux=torch.empty(0, len(self.layers) * self.hidden_size, dtype=self.dtype),
            final=torch.empty(0, self.hidden_size, dtype=self.dtype),
        )

    def run_batch(self, sequences: Sequence[Sequence[int]]) -> list[CapturedStates]:
        """One right-padded forward pass; returns each sample's states unpadded, in input order, on CPU."""
        lengths = [len(s) for s in sequences]
        width = max(lengths, default=0)
        if width == 0:
            return [self._empty() for _ in sequences]
        ids = torch.full((len(sequences), width), self._pad_id, dtype=torch.long)
        mask = torch.zeros((len(sequences), width), dtype=torch.long)
        for row, seq in enumerate(sequences):
            ids[row, : len(seq)] = torch.as_tensor(seq, dtype=torch.long)
            mask[row, : len(seq)] = 1
        self._captured.clear()
        try:
            with torch.inference_mode():
                ids_dev = ids.to(self.device)
                mask_dev = mask.to(self.device)
                self._decoder(input_ids=ids_dev, attention_mask=mask_dev, use_cache=False)
                self.forward_passes += 1
                missing = [k for k in [*self._aux_keys, "final"] if k not in self._captured]
                if missing:
                    raise ConfigError(f"forward pass did not reach hooked modules {missing}")
                keep = mask_dev.bool()
                aux = torch.cat([self._captured[k] for k in self._aux_keys], dim=-1)[keep]
                final = self._captured["final"][keep]
                aux_cpu = aux.to(device="cpu", dtype=self.dtype)
                final_cpu = final.to(device="cpu", dtype=self.dtype)
        finally:
            self._captured.clear()
        return [
            CapturedStates(aux=a, final=f)
            for a, f in zip(aux_cpu.split(lengths), final_cpu.split(lengths), strict=True)
        ]

    def iter_captures(self, sequences: Sequence[Sequence[int]]) -> Iterator[CapturedBatch]:
        """Yield batch by batch so a caller can write states out without holding a whole part in memory."""
        lengths = [len(s) for s in sequences]
        for batch in plan_batches(lengths, self.max_tokens_per_batch):
            states = self.run_batch([sequences[i] for i in batch])
            padded = len(batch) * max(lengths[i] for i in batch)
            yield CapturedBatch(indices=batch, states=states, padded_tokens=padded)

    def close(self) -> None:
        """Remove the hooks and drop the model, so a long-lived process can free accelerator memory."""
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
        del self._model
        del self._decoder
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
