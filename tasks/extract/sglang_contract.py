"""What the SGLang runner and the SGLang engine agree on: the pinned version, the engine spec, one extend's output.

It sits apart from both so that `sglang_backend` (which never imports sglang) and `sglang_engine` (the only
module that does) depend on it and not on each other.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

SGLANG_VERSION = "0.5.23"


def sglang_capture_ids(layers: Sequence[int]) -> list[int]:
    """The layer indices SGLang stores in `layers_to_capture` for our layer-output ids (it adds 1)."""
    return [k + 1 for k in layers]


@dataclass(frozen=True)
class SGLangEngineSpec:
    """Everything an engine process needs to load the target; plain data, so it pickles to TP rank processes."""

    model_path: str
    layers: tuple[int, ...]
    tp_size: int = 1
    dtype: str = "bfloat16"
    mem_fraction_static: float = 0.8
    trust_remote_code: bool = False
    max_tokens_per_batch: int = 8192

    def server_kwargs(self) -> dict[str, Any]:
        """`sglang.srt.server_args.ServerArgs` fields for an in-process capture engine.

        `enable_return_aux_hidden_states` + `speculative_algorithm="EAGLE3"` is SGLang's draft-free capture
        mode: the model runner calls `set_eagle3_layers_to_capture(return_aux_hidden_state_layer_ids)` at load
        and the logits processor returns the packed aux states. The final state is not taken from SGLang's
        output (its `last_hidden_states` is post-norm): the engine hooks the final norm (`FinalNormCapture`).
        `disable_radix_cache` turns prefix caching off; `chunked_prefill_size=-1` keeps each request in one
        extend; CUDA graphs are for decode and never used here.
        """
        return {
            "model_path": self.model_path,
            "tokenizer_path": self.model_path,
            "trust_remote_code": self.trust_remote_code,
            "dtype": self.dtype,
            "tp_size": self.tp_size,
            "mem_fraction_static": self.mem_fraction_static,
            "disable_radix_cache": True,
            "chunked_prefill_size": -1,
            "disable_cuda_graph": True,
            "enable_return_aux_hidden_states": True,
            "speculative_algorithm": "EAGLE3",
            "return_aux_hidden_state_layer_ids": list(self.layers),
            "max_prefill_tokens": self.max_tokens_per_batch,
            "random_seed": 0,
            "log_level": "error",
        }


@dataclass(frozen=True)
class ExtendOutput:
    """One extend pass: `aux` [T, 3H] packed in request order, `final` [T, H] the input of the final norm
    (`storage.FINAL_STATE`; None on TP ranks that keep nothing), and the number of tokens SGLang extended for
    each request (T = their sum when nothing is cached)."""

    aux: torch.Tensor
    final: torch.Tensor | None
    extend_lens: list[int]
