"""Where the target's tokenizer lives on the workers, as a Block, so every flow of a project reconstructs ids
with the same files and the same completion format."""

from __future__ import annotations

from typing import Any

from prefect.blocks.core import Block
from pydantic import Field

from tasks.common.config import TokenizerConfig


class TokenizerSourceBlock(Block):
    _block_type_slug = "eagle3-tokenizer-source"
    _block_type_name = "EAGLE-3 Tokenizer Source"
    _description = "Local model directory holding the target's tokenizer files and chat template."

    path: str = Field(description="Directory on every worker (never a hub id): tokenizer files + chat template.")
    revision: str | None = Field(default=None, description="Recorded in provenance next to the files' hash.")
    trust_remote_code: bool = False
    completion_format: str | dict[str, Any] = Field(
        default="auto",
        description="Preset name, 'auto' to derive from the template, or the format written out: {name, "
        "reasoning_open, reasoning_close, reasoning_pad, content_separator, content_end, end_of_turn, open_in_prompt, "
        "model_writes_pad, omit_empty_reasoning, empty_reasoning_close_only, empty_reasoning_close_tail, pinned_ids}.",
    )
    chat_template_kwargs: dict[str, Any] = Field(
        default_factory=dict, description="Template variables the server renders with, e.g. {'thinking': true}."
    )

    def to_tokenizer_config(self) -> TokenizerConfig:
        return TokenizerConfig.model_validate(
            {
                "path": self.path,
                "revision": self.revision,
                "trust_remote_code": self.trust_remote_code,
                "completion_format": self.completion_format,
                "chat_template_kwargs": self.chat_template_kwargs,
            }
        )
