"""The target model's own final norm, loaded alone, for exports whose trainer wants the post-norm state.

The run stores the final hidden state before the final norm (`storage.FINAL_STATE`). speculators applies the
verifier's norm itself; SpecForge's offline trainer applies only the lm_head (`TargetHead.fc`) to its stored
`hidden_state`, so its export must hold `norm(pre_norm)`. To be exact for every architecture (Llama's RMSNorm,
Gemma's `1 + weight`, a LayerNorm with bias), the norm is the model's own module class: the model is built on
the meta device from its config (no weights, no memory), its decoder's `norm` is taken out, and only that
module's parameters are read from the checkpoint. Applied to the stored states in the dtype the extract ran
in, it computes what the target's norm computed, bit for bit on the same kernels.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import cast

import torch
from safetensors import safe_open
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM

from tasks.export.errors import ExportError

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


def _checkpoint_file(model_dir: Path, key: str) -> Path:
    index = model_dir / INDEX_FILE
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        if key not in weight_map:
            raise ExportError(f"{index} has no weight {key!r} (the final norm's parameter)")
        return model_dir / weight_map[key]
    single = model_dir / SINGLE_FILE
    if single.is_file():
        return single
    raise ExportError(f"{model_dir} holds neither {INDEX_FILE} nor {SINGLE_FILE}: cannot read the final norm")


def load_final_norm(model_dir: Path, dtype: torch.dtype, *, trust_remote_code: bool = False) -> nn.Module:
    """The decoder's final norm of the model in `model_dir`, with its checkpoint weights, in `dtype`, on CPU."""
    model_dir = Path(model_dir)
    if not (model_dir / "config.json").is_file():
        raise ExportError(
            f"the target model directory {model_dir} (extract_model_path of the run, or --target-model) has no "
            "config.json; the specforge export applies the target's final norm and needs it"
        )
    config = AutoConfig.from_pretrained(str(model_dir), trust_remote_code=trust_remote_code, local_files_only=True)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    norm = getattr(model.get_decoder(), "norm", None)
    if not isinstance(norm, nn.Module):
        raise ExportError(f"{type(model).__name__}'s decoder has no `norm` module")
    if any(True for _ in norm.buffers()):
        raise ExportError(f"{type(norm).__name__} holds buffers besides weights; its exact output is not reproducible")
    name = next(n for n, m in model.named_modules() if m is norm)
    params: dict[str, torch.Tensor] = {}
    for param_name, _ in norm.named_parameters():
        key = f"{name}.{param_name}"
        with safe_open(str(_checkpoint_file(model_dir, key)), framework="pt") as fh:
            if key not in set(fh.keys()):
                raise ExportError(f"{model_dir} checkpoint has no weight {key!r} (the final norm's parameter)")
            params[param_name] = fh.get_tensor(key)
    norm = norm.to_empty(device="cpu")
    norm.load_state_dict(params, strict=True)
    return cast(nn.Module, norm.to(dtype).eval().requires_grad_(False))


def apply_norm(norm: nn.Module, states: torch.Tensor) -> torch.Tensor:
    """[L, H] pre-norm -> [L, H] post-norm, in the states' dtype."""
    with torch.no_grad():
        out = norm(states.unsqueeze(0))
    result: torch.Tensor = out[0] if isinstance(out, tuple) else out
    return result[0].to(states.dtype)


def norm_fingerprint(norm: nn.Module) -> str:
    """The applied norm's identity for the export's part markers: its class, settings (`extra_repr`: eps, shape)
    and every parameter's bytes. A re-export with another (or a corrected) target model into the same directory
    must rewrite every file, where the markers over the run's parts alone let it skip them all."""
    digest = hashlib.sha256(f"{type(norm).__qualname__}({norm.extra_repr()})".encode())
    for name, param in sorted(norm.named_parameters()):
        digest.update(name.encode())
        digest.update(param.detach().to(torch.float32).contiguous().numpy().tobytes())
    return digest.hexdigest()
