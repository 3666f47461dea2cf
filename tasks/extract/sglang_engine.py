"""The real SGLang engine behind `sglang_backend.SGLangEngine`: SGLang 0.5.23's own in-process model runner.

SGLang's HTTP/`Engine` API returns hidden states as Python float lists through its detokenizer (a [T, 3H]
list per request: orders of magnitude slower than the forward pass) and only the aux states, not the final
one. This engine instead drives the `ModelRunner` directly, the way SGLang's `sglang.benchmark.one_batch` does
and SpecForge's offline capture does: requests become one `ScheduleBatch`, one extend pass runs with
`CaptureHiddenMode.FULL`, and the packed aux states come back as tensors on the GPU, together with the input of
the decoder's final norm, which a hook on that norm keeps (`FinalNormCapture`; SGLang itself returns only the
post-norm state, see `sglang_backend`). Tensor parallelism: rank 0 runs in this process, ranks 1..tp-1 in
spawned processes that run the same batches (SGLang's collectives need every rank in each forward); only rank
0's tensors are kept (and only rank 0 hooks its final norm).

Only this module imports sglang, lazily; it is exercised on GPU machines with `sglang==0.5.23` installed.
What was and was not verified without one is written in docs/extraction.md.
"""

from __future__ import annotations

import importlib.metadata
import multiprocessing as mp
import queue
from array import array
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tasks.common.errors import ConfigError
from tasks.extract.sglang_contract import SGLANG_VERSION, ExtendOutput, SGLangEngineSpec

READY_TIMEOUT_S = 3600.0
"""Loading a 1T-parameter checkpoint over TP ranks can take tens of minutes."""


def read_num_layers(model_path: Path, trust_remote_code: bool = False) -> int:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(model_path), trust_remote_code=trust_remote_code, local_files_only=True)
    return int(config.get_text_config().num_hidden_layers)


def require_sglang() -> None:
    try:
        version = importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError as exc:
        raise ConfigError(
            f"extract.backend sglang needs sglang=={SGLANG_VERSION} (pip install 'eagle3-datagen[sglang]' "
            "in the GPU image)"
        ) from exc
    if version != SGLANG_VERSION:
        raise ConfigError(f"extract.backend sglang is written against sglang=={SGLANG_VERSION}, found {version}")


def _server_args(spec: SGLangEngineSpec) -> tuple[Any, Any]:
    from sglang.srt.entrypoints.engine import _set_envs_and_config
    from sglang.srt.server_args import PortArgs, ServerArgs

    server_args = ServerArgs(**spec.server_kwargs())
    server_args.resolve_once()
    _set_envs_and_config(server_args)
    return server_args, PortArgs.init_new(server_args)


def _load_rank(server_args: Any, port_args: Any, tp_rank: int) -> Any:
    """One TP rank's `ModelRunner`, set up as `sglang.benchmark.one_batch` sets up its ranks."""
    from sglang.benchmark import one_batch
    from sglang.srt.runtime_context import SpawnRanks, publish, spawn_world_rank
    from sglang.srt.utils import configure_logger

    gpu_id = tp_rank
    publish(
        server_args,
        role="scheduler",
        ranks=SpawnRanks(world_rank=spawn_world_rank(server_args, tp_rank=tp_rank, pp_rank=0), gpu_id=gpu_id),
    )
    one_batch._init_process_global_configs()
    configure_logger(server_args, prefix=f" TP{tp_rank}")
    bench_runner, _tokenizer = one_batch.load_model(server_args, port_args, gpu_id, tp_rank)
    return bench_runner.torch_runner


def build_requests(sequences: Sequence[Sequence[int]], req_cls: Any, sampling_params: Any) -> list[Any]:
    """One SGLang `Req` per sequence, prepared for a single full extend the way `one_batch` prepares its
    synthetic requests: nothing matched from a prefix, the whole sequence to extend, hidden states requested."""
    reqs = []
    for i, seq in enumerate(sequences):
        req = req_cls(
            rid=str(i),
            origin_input_text="",
            origin_input_ids=array("q", seq),
            sampling_params=sampling_params,
            return_hidden_states=True,
        )
        req.full_untruncated_fill_ids = req.origin_input_ids
        req.logprob_start_len = -1
        req.extend_end = len(req.origin_input_ids)
        reqs.append(req)
    return reqs


def _rows(states: torch.Tensor) -> torch.Tensor:
    """An owned [tokens, H] copy (SGLang passes [T, H]; a padded [B, L, H] input is flattened the same way)."""
    return states.detach().reshape(-1, states.shape[-1]).clone()


class FinalNormCapture:
    """Keeps the input of a decoder's final norm for every call during one extend pass.

    SGLang 0.5.23 calls the final norm either as `norm(hidden_states)` (returns the normed tensor) or, with its
    fused add + RMSNorm, as `norm(hidden_states, residual)` (returns `(normed, hidden_states + residual)`,
    updating the residual in place, `layers/layer_boundary/residual/access.py:final_norm_pair`). The pre-norm
    state is then the input in the first form and the returned residual in the second: exactly what the kernel
    normalized. Each is cloned, since SGLang reuses that storage. A pass in which the norm never ran (CUDA graph
    replay, a model whose final norm is fused into its last MoE layer) yields nothing and is refused by `take`.
    """

    def __init__(self, norm: nn.Module) -> None:
        self._chunks: list[torch.Tensor] = []
        self._fused = False
        self._handles = [
            norm.register_forward_pre_hook(self._before, with_kwargs=True),
            norm.register_forward_hook(self._after),
        ]

    def _before(self, module: nn.Module, args: Any, kwargs: dict[str, Any]) -> None:
        residual = args[1] if len(args) > 1 else kwargs.get("residual")
        self._fused = isinstance(residual, torch.Tensor)
        if not self._fused:
            hidden = args[0] if args else kwargs.get("x", kwargs.get("hidden_states"))
            if not isinstance(hidden, torch.Tensor):
                raise ConfigError(f"{type(module).__name__} was called without a hidden-state tensor")
            self._chunks.append(_rows(hidden))

    def _after(self, module: nn.Module, args: Any, output: Any) -> None:
        if not self._fused:
            return
        if not (isinstance(output, tuple) and len(output) == 2 and isinstance(output[1], torch.Tensor)):
            raise ConfigError(
                f"{type(module).__name__}(hidden_states, residual) returned {type(output).__name__}, expected "
                "(normed, updated residual) as in SGLang 0.5.23"
            )
        self._chunks.append(_rows(output[1]))

    def reset(self) -> None:
        self._chunks.clear()

    def take(self) -> torch.Tensor:
        """The pass's pre-norm rows, in call order; raises if the norm did not run."""
        chunks, self._chunks = self._chunks, []
        if not chunks:
            raise ConfigError(
                "the final norm's hook did not fire during the extend pass (CUDA graph, or a model that fuses its "
                "final norm elsewhere): the pre-norm final state cannot be captured"
            )
        return chunks[0] if len(chunks) == 1 else torch.cat(chunks)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


def _extend(
    model_runner: Any, sequences: Sequence[Sequence[int]], final_norm: FinalNormCapture | None = None
) -> ExtendOutput:
    """One extend pass over `sequences` with full hidden-state capture (and, given `final_norm`, the input of the
    final norm); pools are cleared afterwards so every pass starts from an empty KV cache (nothing is ever
    served from a cached prefix)."""
    from sglang.benchmark import one_batch
    from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
    from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardBatch
    from sglang.srt.runtime_context import get_schedule
    from sglang.srt.sampling.sampling_params import SamplingParams
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    reqs = build_requests(sequences, Req, SamplingParams(temperature=0, max_new_tokens=1))
    tree_cache = one_batch.TreeCacheNamespace(
        page_size=get_schedule().page_size,
        device=model_runner.device,
        token_to_kv_pool_allocator=model_runner.token_to_kv_pool_allocator,
    )
    if final_norm is not None:
        final_norm.reset()
    try:
        batch = ScheduleBatch.init_new(
            reqs=reqs,
            req_to_token_pool=model_runner.req_to_token_pool,
            token_to_kv_pool_allocator=model_runner.token_to_kv_pool_allocator,
            tree_cache=tree_cache,
            model_config=model_runner.model_config,
            enable_overlap=False,
            spec_algorithm=SpeculativeAlgorithm.NONE,
        )
        batch.prepare_for_extend()
        one_batch._maybe_prepare_mlp_sync_batch(batch, model_runner)
        if batch.input_ids is None and getattr(batch, "prefill_input_ids_cpu", None) is not None:
            batch.input_ids = batch.prefill_input_ids_cpu.to(batch.device, non_blocking=True)
            batch.prefill_input_ids_cpu = None
        forward_batch = ForwardBatch.init_new(
            batch,
            model_runner,
            capture_hidden_mode=CaptureHiddenMode.FULL,
            return_hidden_states_before_norm=False,
        )
        output = model_runner.forward(forward_batch).logits_output
        if output.hidden_states is None:
            raise ConfigError(
                "SGLang returned no aux hidden states: is enable_return_aux_hidden_states on "
                "and does this model implement set_eagle3_layers_to_capture?"
            )
        aux: torch.Tensor = output.hidden_states
        final = final_norm.take().to(aux.dtype) if final_norm is not None else None
        return ExtendOutput(aux, final, [int(n) for n in batch.extend_lens])
    finally:
        if final_norm is not None:
            final_norm.reset()
        model_runner.req_to_token_pool.clear()
        model_runner.token_to_kv_pool_allocator.clear()


def _decoder(model: Any) -> Any:
    """The decoder SGLang hooks (`model.model` for text models, a language model's for VLMs): the node holding
    `layers_to_capture`."""
    for path in ("model", "language_model.model", "language_model"):
        node = model
        for name in path.split("."):
            node = getattr(node, name, None)
        if getattr(node, "layers_to_capture", None) is not None:
            return node
    raise ConfigError(f"{type(model).__name__} exposes no layers_to_capture: SGLang cannot capture its aux states")


def _layers_to_capture(model: Any) -> list[int]:
    return [int(i) for i in _decoder(model).layers_to_capture]


def _final_norm(model: Any) -> nn.Module:
    norm = getattr(_decoder(model), "norm", None)
    if not isinstance(norm, nn.Module):
        raise ConfigError(
            f"{type(model).__name__}'s decoder has no final `norm` module (pipeline parallel?): its pre-norm "
            "final state cannot be captured"
        )
    return norm


def _rank_main(server_args: Any, port_args: Any, tp_rank: int, inbox: Any, outbox: Any) -> None:
    """TP rank > 0: load, report ready, then run every batch rank 0 runs, until told to stop."""
    try:
        model_runner = _load_rank(server_args, port_args, tp_rank)
        outbox.put(("ready", tp_rank, ""))
        while True:
            sequences = inbox.get()
            if sequences is None:
                return
            _extend(model_runner, sequences)
    except BaseException as exc:
        outbox.put(("error", tp_rank, f"{type(exc).__name__}: {exc}"))
        raise


class InProcessSGLangEngine:
    """`SGLangEngine` over SGLang's ModelRunner: rank 0 here, other TP ranks in spawned processes."""

    def __init__(self, spec: SGLangEngineSpec) -> None:
        require_sglang()
        self.spec = spec
        server_args, port_args = _server_args(spec)
        ctx = mp.get_context("spawn")
        self._outbox: Any = ctx.Queue()
        self._inboxes: list[Any] = []
        self._workers: list[Any] = []
        for rank in range(1, spec.tp_size):
            inbox = ctx.Queue()
            worker = ctx.Process(
                target=_rank_main, args=(server_args, port_args, rank, inbox, self._outbox), daemon=True
            )
            worker.start()
            self._inboxes.append(inbox)
            self._workers.append(worker)
        try:
            self._runner = _load_rank(server_args, port_args, 0)
            self._await_ready()
            self._final_norm = FinalNormCapture(_final_norm(self._runner.model))
        except BaseException:
            self.close()
            raise
        config = self._runner.model_config
        self.num_layers = int(config.hf_text_config.num_hidden_layers)
        self.hidden_size = int(config.hidden_size)
        self.max_batch_tokens = int(self._runner.max_total_num_tokens)
        self.max_batch_requests = int(self._runner.req_to_token_pool.size)

    def _await_ready(self) -> None:
        pending = set(range(1, self.spec.tp_size))
        while pending:
            try:
                kind, rank, message = self._outbox.get(timeout=READY_TIMEOUT_S)
            except queue.Empty as exc:
                raise ConfigError(f"SGLang TP ranks {sorted(pending)} did not load in {READY_TIMEOUT_S} s") from exc
            if kind == "error":
                raise ConfigError(f"SGLang TP rank {rank} failed to load: {message}")
            pending.discard(rank)

    def _check_workers(self) -> None:
        try:
            kind, rank, message = self._outbox.get_nowait()
        except queue.Empty:
            return
        raise ConfigError(f"SGLang TP rank {rank} stopped ({kind}): {message}")

    def captured_layer_ids(self) -> list[int]:
        return _layers_to_capture(self._runner.model)

    def extend(self, sequences: Sequence[Sequence[int]]) -> ExtendOutput:
        self._check_workers()
        batch = [list(s) for s in sequences]
        for inbox in self._inboxes:
            inbox.put(batch)
        return _extend(self._runner, batch, self._final_norm)

    def close(self) -> None:
        final_norm = getattr(self, "_final_norm", None)
        if final_norm is not None:
            final_norm.remove()
        for inbox in self._inboxes:
            inbox.put(None)
        for worker in self._workers:
            worker.join(timeout=60)
            if worker.is_alive():
                worker.terminate()
        self._inboxes.clear()
        self._workers.clear()
