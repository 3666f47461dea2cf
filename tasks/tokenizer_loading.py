"""Tokenizers come from a local model directory only (never a hub); the revision recorded in provenance is a
hash of the tokenizer files, so two runs that disagree on ids can be told apart by their metadata."""

from __future__ import annotations

import hashlib
from functools import lru_cache
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from tasks.config import TokenizerConfig
from tasks.errors import ConfigError
from tasks.messages import Message

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tiktoken.model", "special_tokens_map.json")


def tokenizer_hash(path: Path) -> str:
    digest = hashlib.sha256()
    for name in TOKENIZER_FILES:
        f = path / name
        if f.is_file():
            digest.update(name.encode())
            digest.update(f.read_bytes())
    return digest.hexdigest()[:16]


@lru_cache(maxsize=4)
def _load(path: str, trust_remote_code: bool) -> PreTrainedTokenizerBase:
    if not Path(path).is_dir():
        raise ConfigError(f"tokenizer.path {path} is not a local directory")
    tok: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(
        path, trust_remote_code=trust_remote_code, local_files_only=True
    )
    return tok


def load_tokenizer(cfg: TokenizerConfig) -> PreTrainedTokenizerBase:
    return _load(str(cfg.path), cfg.trust_remote_code)


def tokenizer_provenance(cfg: TokenizerConfig) -> dict[str, Any]:
    return {"tokenizer_revision": cfg.revision, "tokenizer_hash": tokenizer_hash(cfg.path)}


def render_prompt(tokenizer: PreTrainedTokenizerBase, messages: list[Message]) -> str:
    """The prompt exactly as the server renders it before generating: chat template + generation prompt."""
    text = tokenizer.apply_chat_template(
        [dict(m) for m in messages], tokenize=False, add_generation_prompt=True
    )
    if not isinstance(text, str):
        raise TypeError(f"chat template rendered {type(text).__name__}, expected str")
    return text


def render_prompt_ids(tokenizer: PreTrainedTokenizerBase, messages: list[Message]) -> list[int]:
    ids: list[int] = tokenizer.encode(render_prompt(tokenizer, messages), add_special_tokens=False)
    return ids
