"""The hidden-state backend as a Block: the GPU pool's hardware choices (backend, devices, layers) stay with the
pool's operators instead of being copied into every run config."""

from __future__ import annotations

from typing import Any, Literal

from prefect.blocks.core import Block
from pydantic import Field

from tasks.common.config import ExtractConfig


class HiddenStateBackendBlock(Block):
    _block_type_slug = "eagle3-hidden-state-backend"
    _block_type_name = "EAGLE-3 Hidden-State Backend"
    _description = "How the GPU stage runs the target model: backend, devices, captured layers."

    backend: Literal["hf", "sglang"] = "hf"
    device: str = Field(default="auto", description="auto, cpu, cuda or cuda:N")
    model_path: str | None = Field(
        default=None, description="Target weights on the GPU host; defaults to the tokenizer path."
    )
    layers: list[int] | None = Field(default=None, description="0-based aux layers; default [1, N//2-1, N-4].")
    dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"
    max_tokens_per_batch: int = Field(default=8192, ge=1)
    device_map: Literal["auto", "balanced", "balanced_low_0", "sequential"] | None = Field(
        default=None, description="hf: spread the model over all visible GPUs (a model larger than one GPU)."
    )
    tp_size: int = Field(default=1, ge=1, description="sglang: tensor-parallel GPUs.")
    sglang_mem_fraction_static: float = Field(default=0.8, gt=0, lt=1, description="sglang: GPU memory fraction.")

    def to_extract_config(self, base: ExtractConfig | None = None) -> ExtractConfig:
        fields: dict[str, Any] = base.model_dump() if base is not None else {}
        fields.update(
            backend=self.backend,
            device=self.device,
            layers=self.layers,
            dtype=self.dtype,
            max_tokens_per_batch=self.max_tokens_per_batch,
            device_map=self.device_map,
            tp_size=self.tp_size,
            sglang_mem_fraction_static=self.sglang_mem_fraction_static,
        )
        if self.model_path is not None:
            fields["model_path"] = self.model_path
        return ExtractConfig.model_validate(fields)
