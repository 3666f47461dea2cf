"""Hidden-state capture with SGLang (pinned to 0.5.23): the runner the stage sees, independent of SGLang itself.

SGLang serves the models the HF backend cannot hold in one process (Kimi-K2.5, DeepSeek-V3: tensor parallel,
its own MoE and MLA kernels), and computing the drafter's states with the same kernels the target serves with
keeps training and serving numerics alike. Everything SGLang-specific sits behind `SGLangEngine`, one small
protocol; `sglang_engine.InProcessSGLangEngine` is the real one (imports sglang), tests drive this runner with a
fake that follows the same shapes. This module never imports sglang.

Layer convention: this project's layer id k is the output of decoder layer k (0-based), i.e. HF
`output_hidden_states[k + 1]`. SGLang's `set_eagle3_layers_to_capture(ids)` stores `ids + 1` in
`model.layers_to_capture` and records the residual stream *entering* each of those layers, which is the output
of the layer before: passing our ids unchanged therefore captures exactly our layers ([1, N//2-1, N-4] become
SGLang's [2, N//2, N-3]). The runner reads `layers_to_capture` back from the loaded model and refuses to run
if it is not `[k + 1 for k in layers]`, so a change of that convention in SGLang fails before any state is
written.

Final state: this project stores the input of the final norm (`storage.FINAL_STATE`). SGLang 0.5.23 does not
return it for the models this backend is for: `LogitsProcessorOutput.last_hidden_states` is the *post*-norm
state, and its `return_hidden_states_before_norm` path exists only for a few models (DeepSeek-V4, MiMo-V2,
Step-3.5) and, when set, *replaces* the packed aux states in `hidden_states`. A post-norm state cannot be turned
back into the pre-norm one (RMSNorm discards the scale), so the engine hooks the decoder's final norm itself
(`sglang_engine.FinalNormCapture`): with SGLang's fused add + norm, `norm(hidden_states, residual)` returns
`(normed, hidden_states + residual)`, and that updated residual is exactly the tensor the kernel normalized,
the same sum SGLang records for the aux states and vLLM for its final state.

Alignment: SGLang reports, per request, how many tokens it extended (`extend_lens`); prefix caching would
make that smaller than the request (a cached prefix returns no states, the failure mode of vLLM issue 44485),
so the engine disables the radix cache and the stage's writer compares every count with the sample's length.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch

from tasks.common.errors import ConfigError
from tasks.extract.capture import CapturedBatch, plan_ragged_batches
from tasks.extract.layers import resolve_layers
from tasks.extract.sglang_contract import SGLANG_VERSION, ExtendOutput, SGLangEngineSpec, sglang_capture_ids
from tasks.extract.storage import DTYPES, FINAL_STATE, NO_FINAL_STATE, StateLayout

if TYPE_CHECKING:
    from tasks.common.config import PipelineConfig


class SGLangEngine(Protocol):
    num_layers: int
    hidden_size: int
    max_batch_tokens: int
    max_batch_requests: int

    def captured_layer_ids(self) -> list[int]:
        """`model.layers_to_capture` of the loaded model (SGLang's internal, input-of-layer ids)."""
        ...

    def extend(self, sequences: Sequence[Sequence[int]]) -> ExtendOutput: ...

    def close(self) -> None: ...


class SGLangHiddenStateRunner:
    """The stage's runner over an SGLang engine: batch planning, the layer-convention check, unpacking."""

    backend = "sglang"
    scores_in_pass = False
    """SGLang keeps its lm_head to itself (vocabulary-parallel across ranks): the stage scores the stored final
    states through the target's norm and lm_head after each part (`scores.rescore_part`)."""

    def __init__(
        self,
        engine: SGLangEngine,
        *,
        model_path: Path,
        layers: Sequence[int] | None,
        dtype: str,
        max_tokens_per_batch: int,
        store_final_state: bool = True,
        tp_size: int = 1,
    ) -> None:
        if dtype not in DTYPES:
            raise ConfigError(f"extract.dtype {dtype!r} not one of {sorted(DTYPES)}")
        self.engine = engine
        self.model_path = Path(model_path)
        self.num_layers = engine.num_layers
        self.hidden_size = engine.hidden_size
        self.layers = resolve_layers(layers, self.num_layers)
        self.dtype_name = dtype
        self.dtype = DTYPES[dtype]
        self.max_tokens_per_batch = max_tokens_per_batch
        self.store_final_state = store_final_state
        self.tp_size = tp_size
        self.layout = StateLayout(tuple(self.layers), self.hidden_size, self.dtype, store_final_state)
        expected = sglang_capture_ids(self.layers)
        actual = list(engine.captured_layer_ids())
        if actual != expected:
            raise ConfigError(
                f"SGLang captures the inputs of layers {actual}, expected {expected} for layer outputs "
                f"{self.layers}: the layer-id convention of this SGLang build differs from {SGLANG_VERSION}'s"
            )
        self.forward_passes = 0

    @classmethod
    def from_config(cls, cfg: PipelineConfig) -> SGLangHiddenStateRunner:
        from tasks.extract.sglang_engine import InProcessSGLangEngine, read_num_layers

        model_path = cfg.extract_model_path
        layers = resolve_layers(cfg.extract.layers, read_num_layers(model_path, cfg.tokenizer.trust_remote_code))
        spec = SGLangEngineSpec(
            model_path=str(model_path),
            layers=tuple(layers),
            tp_size=cfg.extract.tp_size,
            dtype=cfg.extract.dtype,
            mem_fraction_static=cfg.extract.sglang_mem_fraction_static,
            trust_remote_code=cfg.tokenizer.trust_remote_code,
            max_tokens_per_batch=cfg.extract.max_tokens_per_batch,
        )
        return cls(
            InProcessSGLangEngine(spec),
            model_path=model_path,
            layers=layers,
            dtype=cfg.extract.dtype,
            max_tokens_per_batch=cfg.extract.max_tokens_per_batch,
            store_final_state=cfg.extract.store_final_state,
            tp_size=cfg.extract.tp_size,
        )

    def provenance(self) -> dict[str, Any]:
        return {
            "extract_backend": self.backend,
            "extract_model_path": str(self.model_path),
            "extract_layers": list(self.layers),
            "extract_sglang_capture_ids": sglang_capture_ids(self.layers),
            "extract_dtype": self.dtype_name,
            "extract_num_layers": self.num_layers,
            "extract_hidden_size": self.hidden_size,
            "extract_tp_size": self.tp_size,
            "extract_store_final_state": self.store_final_state,
            "extract_final_state": FINAL_STATE if self.store_final_state else NO_FINAL_STATE,
            "sglang_version": SGLANG_VERSION,
            "torch_version": torch.__version__,
        }

    def plan_batches(self, lengths: Sequence[int]) -> list[list[int]]:
        budget = min(self.max_tokens_per_batch, self.engine.max_batch_tokens)
        too_long = [(i, n) for i, n in enumerate(lengths) if n > self.engine.max_batch_tokens]
        if too_long:
            i, n = too_long[0]
            raise ConfigError(
                f"sample {i} of the part has {n} tokens; the SGLang KV pool holds {self.engine.max_batch_tokens} "
                "(raise extract.sglang_mem_fraction_static or tp_size)"
            )
        return plan_ragged_batches(lengths, budget, self.engine.max_batch_requests)

    def scoring(self, score_from: Sequence[int], chunk_tokens: int) -> AbstractContextManager[None]:
        raise ConfigError("the sglang runner does not score in the forward pass (scores_in_pass is false)")

    def iter_captures(
        self, sequences: Sequence[Sequence[int]], batches: Sequence[Sequence[int]]
    ) -> Iterator[CapturedBatch]:
        for batch in batches:
            out = self.engine.extend([sequences[i] for i in batch])
            self.forward_passes += 1
            yield unpack_extend(out, list(batch), self.layout)

    def close(self) -> None:
        self.engine.close()


def unpack_extend(out: ExtendOutput, indices: list[int], layout: StateLayout) -> CapturedBatch:
    """An extend pass as a `CapturedBatch`: SGLang's per-request extend lengths become the row counts the
    stage checks against each sample's token count; the final state is dropped for aux-only layouts. Dtypes
    pass through unconverted, so a model running in another dtype than configured fails the writer's check."""
    if len(out.extend_lens) != len(indices):
        raise ConfigError(f"SGLang returned {len(out.extend_lens)} extend lengths for {len(indices)} requests")
    if layout.store_final_state and out.final is None:
        raise ConfigError("SGLang engine returned no final-norm input for a layout that stores the final state")
    final = out.final if layout.store_final_state else None
    for name, tensor, width in (("aux", out.aux, layout.aux_width), ("final", final, layout.hidden_size)):
        if tensor is not None and (tensor.ndim != 2 or tensor.shape[1] != width):
            raise ConfigError(f"SGLang {name} hidden states have shape {tuple(tensor.shape)}, expected [T, {width}]")
    return CapturedBatch(indices, list(out.extend_lens), out.aux, final, sum(out.extend_lens))
