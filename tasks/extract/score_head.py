"""The target's own next-token distribution over answer tokens: its final norm and lm_head, on the device, in chunks.

Invariant: the score of answer token `t` at position `p` is `log_softmax(lm_head(norm(h[p - 1])))[t]`, the
target's log-probability of the token it is trained to predict there, and `top1` says whether `t` reaches the
largest logit. Only `chunk_tokens` rows of full-vocabulary logits exist at once, on the device that holds the
lm_head; one float and one bool per token leave it. Logits come out of the lm_head in the model's dtype, as the
model computes them, and are reduced in float32 (as transformers' loss does).

Two sources of `h`: the decoder's own normed output during extraction (`score_normed`: the norm already ran,
exactly as the CausalLM feeds its lm_head), or a stored pre-norm final state (`score_pre_norm`: the model's own
norm module is applied first). A head is taken from a loaded model (`from_model`), or read alone from a
checkpoint (`load`: the model built on the meta device from its config, only the norm's and the lm_head's
weights read), for backends that do not expose the lm_head and for rescoring stored states without a forward pass.

Models whose CausalLM transforms its logits are reproduced from their config: Gemma's
`final_logit_softcapping` (tanh), Cohere's `logit_scale` (multiply) and Granite's `logits_scaling` (divide),
applied in float32.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import torch
from safetensors import safe_open
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from tasks.common.errors import ConfigError
from tasks.extract.devices import module_device

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"

LogitTransform = Callable[[torch.Tensor], torch.Tensor]


def _softcap(cap: float) -> LogitTransform:
    return lambda x: torch.tanh(x / cap) * cap


def _scale(factor: float) -> LogitTransform:
    return lambda x: x * factor


LOGIT_TRANSFORMS: tuple[tuple[str, Callable[[float], bool], Callable[[float], LogitTransform]], ...] = (
    ("final_logit_softcapping", lambda v: v > 0, _softcap),  # Gemma 2/3
    ("logit_scale", lambda v: v != 1, _scale),  # Cohere
    ("logits_scaling", lambda v: v not in (0, 1), lambda v: _scale(1 / v)),  # Granite
)
"""(config attribute, whether its value changes the logits, the transform it stands for)."""


def logit_transforms(config: Any) -> list[tuple[str, LogitTransform]]:
    """What the model's CausalLM does to `lm_head(x)` before its softmax, read from its (text) config."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    out: list[tuple[str, LogitTransform]] = []
    for name, applies, build in LOGIT_TRANSFORMS:
        values = [getattr(c, name, None) for c in (text, config)]
        value = next((v for v in values if isinstance(v, int | float) and not isinstance(v, bool)), None)
        if value is not None and applies(float(value)):
            out.append((name, build(float(value))))
    return out


def _execution_device(module: nn.Module) -> torch.device:
    """Where `module` computes (accelerate's hook when the model was dispatched, else its parameters)."""
    return module_device(module, torch.device("cpu"))


class ScoreHead:
    """The final norm (None when only normed inputs are scored) and the lm_head of one target model."""

    def __init__(
        self,
        norm: nn.Module | None,
        lm_head: nn.Module,
        *,
        transforms: list[tuple[str, LogitTransform]] | None = None,
        source: str = "model",
    ) -> None:
        self.norm = norm
        self.lm_head = lm_head
        self.transforms = transforms or []
        self.source = source
        self.device = _execution_device(lm_head)
        weight = getattr(lm_head, "weight", None)
        out_features = getattr(lm_head, "out_features", None)
        if isinstance(out_features, int):
            self.vocab_size = out_features
        elif isinstance(weight, torch.Tensor):
            self.vocab_size = int(weight.shape[0])
        else:
            raise ConfigError(f"cannot tell the vocabulary size of the lm_head {type(lm_head).__name__}")

    @classmethod
    def from_model(cls, model: PreTrainedModel) -> ScoreHead:
        lm_head = model.get_output_embeddings()
        norm = getattr(model.get_decoder(), "norm", None)
        if not isinstance(lm_head, nn.Module):
            raise ConfigError(f"{type(model).__name__} has no output embeddings (lm_head) to score answers with")
        return cls(norm if isinstance(norm, nn.Module) else None, lm_head, transforms=logit_transforms(model.config))

    @classmethod
    def load(
        cls, model_dir: Path, dtype: torch.dtype, device: torch.device, *, trust_remote_code: bool = False
    ) -> ScoreHead:
        """The norm and lm_head of the checkpoint in `model_dir` alone, in `dtype`, on `device`."""
        model_dir = Path(model_dir)
        if not (model_dir / "config.json").is_file():
            raise ConfigError(f"the target model directory {model_dir} has no config.json; scoring reads its lm_head")
        config = AutoConfig.from_pretrained(str(model_dir), trust_remote_code=trust_remote_code, local_files_only=True)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
        norm = getattr(model.get_decoder(), "norm", None)
        lm_head = model.get_output_embeddings()
        embeddings = model.get_input_embeddings()
        if not isinstance(norm, nn.Module) or not isinstance(lm_head, nn.Module):
            raise ConfigError(f"{type(model).__name__} lacks a decoder `norm` or an lm_head; cannot score answers")
        names = {id(m): n for n, m in model.named_modules()}
        tied = bool(getattr(config.get_text_config(), "tie_word_embeddings", False)) or bool(
            getattr(config, "tie_word_embeddings", False)
        )
        modules = []
        for module in (norm, lm_head):
            params: dict[str, torch.Tensor] = {}
            for param_name, _ in module.named_parameters():
                key = f"{names[id(module)]}.{param_name}"
                fallback = f"{names[id(embeddings)]}.{param_name}" if module is lm_head and tied else None
                params[param_name] = _read_weight(model_dir, key, fallback)
            loaded = module.to_empty(device=device)
            loaded.load_state_dict(params, strict=True)
            modules.append(cast(nn.Module, loaded.to(dtype).eval().requires_grad_(False)))
        return cls(modules[0], modules[1], transforms=logit_transforms(config), source=f"checkpoint:{model_dir}")

    def _logits(self, rows: torch.Tensor) -> torch.Tensor:
        """float32 [rows, vocab], a tensor of its own (the caller reduces it in place)."""
        logits: torch.Tensor = self.lm_head(rows.to(self.device, non_blocking=True)).float()
        for _, transform in self.transforms:
            logits = transform(logits)
        return logits

    def score_normed(
        self, normed: torch.Tensor, rows: torch.Tensor, targets: torch.Tensor, chunk_tokens: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(log-probabilities float32 [S], top-1 flags bool [S]) of `targets[s]` given `normed[rows[s]]`."""
        return self._score(normed, rows, targets, chunk_tokens, apply_norm=False)

    def score_pre_norm(
        self, states: torch.Tensor, rows: torch.Tensor, targets: torch.Tensor, chunk_tokens: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """As `score_normed`, from pre-norm final states (the stored `hidden_states`): the norm runs first."""
        if self.norm is None:
            raise ConfigError("this score head has no final norm; it scores normed states only")
        return self._score(states, rows, targets, chunk_tokens, apply_norm=True)

    def _score(
        self, states: torch.Tensor, rows: torch.Tensor, targets: torch.Tensor, chunk_tokens: int, apply_norm: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if chunk_tokens < 1:
            raise ConfigError(f"scoring.logits_chunk_tokens must be >= 1, got {chunk_tokens}")
        n = int(rows.shape[0])
        logprobs = torch.empty(n, dtype=torch.float32, device=self.device)
        top1 = torch.empty(n, dtype=torch.bool, device=self.device)
        rows = rows.to(states.device, non_blocking=True)
        targets = targets.to(self.device, non_blocking=True)
        with torch.inference_mode():
            for start in range(0, n, chunk_tokens):
                end = min(n, start + chunk_tokens)
                picked_rows = states.index_select(0, rows[start:end])
                if apply_norm:
                    assert self.norm is not None
                    out = self.norm(picked_rows)
                    picked_rows = out[0] if isinstance(out, tuple) else out
                logits = self._logits(picked_rows)
                wanted = logits.gather(1, targets[start:end, None]).squeeze(1)
                peak = logits.amax(dim=1)
                top1[start:end] = wanted >= peak
                # log-sum-exp in place: no second [chunk, vocab] buffer (a third of the time on a CPU)
                total = logits.sub_(peak[:, None]).exp_().sum(dim=1)
                logprobs[start:end] = wanted - peak - total.log()
                del logits
        return logprobs, top1

    def describe(self) -> dict[str, Any]:
        return {
            "score_head": self.source,
            "score_vocab_size": self.vocab_size,
            "score_logit_transforms": [name for name, _ in self.transforms],
        }


def _weight_file(model_dir: Path, key: str) -> Path | None:
    index = model_dir / INDEX_FILE
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        return model_dir / weight_map[key] if key in weight_map else None
    single = model_dir / SINGLE_FILE
    return single if single.is_file() else None


def _read_weight(model_dir: Path, key: str, fallback: str | None) -> torch.Tensor:
    for name in (key, fallback):
        if name is None:
            continue
        path = _weight_file(model_dir, name)
        if path is None:
            continue
        with safe_open(str(path), framework="pt") as fh:
            if name in set(fh.keys()):
                return fh.get_tensor(name)
    also = f" (nor the tied {fallback!r})" if fallback else ""
    raise ConfigError(f"{model_dir} checkpoint has no weight {key!r}{also}; scoring needs the final norm and lm_head")


def first_scored_position(prompt_len: int, length: int) -> int:
    """Answer tokens are positions [prompt_len, length); position 0 has no context to be predicted from."""
    return min(max(1, prompt_len), length)


def plan_token_scores(
    sequences: list[list[int]] | tuple[list[int], ...],
    score_from: list[int],
    offsets: list[int],
    pin: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """(rows [S], targets [S], counts) for scoring: sample n's token at position p (p >= score_from[n]) is
    predicted by the state at row offsets[n] + p - 1 of the flattened states. Built on the host, as index
    tensors (pinned for an asynchronous copy when `pin`): a boolean mask would make the host wait for the device."""
    counts = [len(seq) - start for seq, start in zip(sequences, score_from, strict=True)]
    rows = torch.empty(sum(counts), dtype=torch.long)
    targets = torch.empty(sum(counts), dtype=torch.long)
    cursor = 0
    for seq, start, offset, count in zip(sequences, score_from, offsets, counts, strict=True):
        if count <= 0:
            continue
        rows[cursor : cursor + count] = torch.arange(offset + start - 1, offset + len(seq) - 1)
        targets[cursor : cursor + count] = torch.as_tensor(seq[start:], dtype=torch.long)
        cursor += count
    counts = [max(0, c) for c in counts]
    if pin:
        rows, targets = rows.pin_memory(), targets.pin_memory()
    return rows, targets, counts
