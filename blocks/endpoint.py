"""An inference endpoint stored as a Prefect Block, so the API key lives on the server and never in a flow
parameter, a YAML file in git, or a task's inputs. It converts to the same strict `EndpointConfig` the YAML gives."""

from __future__ import annotations

from typing import Any, Literal

from prefect.blocks.core import Block
from pydantic import Field, SecretStr

from tasks.common.config import EndpointConfig


class InferenceEndpointBlock(Block):
    _block_type_slug = "eagle3-inference-endpoint"
    _block_type_name = "EAGLE-3 Inference Endpoint"
    _description = "OpenAI-compatible or SGLang endpoint the generate stage sends requests to."

    kind: Literal["openai_chat", "sglang_generate"] = "openai_chat"
    base_url: str = Field(description="e.g. https://openrouter.ai/api or http://sglang-host:30000")
    model: str
    api_key: SecretStr | None = None
    max_in_flight: int = Field(default=2000, ge=1)
    provider_routing: dict[str, Any] | None = Field(
        default=None, description="OpenRouter provider object, e.g. {order: [...], quantizations: [fp8]}."
    )
    reasoning: dict[str, Any] | None = Field(default=None, description="OpenRouter reasoning object.")
    stream: bool | None = Field(default=None, description="Empty: streaming for openai_chat, not for sglang_generate.")
    max_cost_usd: float | None = Field(
        default=None, gt=0, description="Hard spend cap for a run directory; empty keeps the YAML's cap."
    )
    price_prompt_usd_per_mtok: float | None = Field(default=None, ge=0, description="Empty keeps the YAML's.")
    price_completion_usd_per_mtok: float | None = Field(default=None, ge=0, description="Empty keeps the YAML's.")

    def to_endpoint_config(self, base: EndpointConfig | None = None) -> EndpointConfig:
        """Block fields win over the YAML's endpoint section; everything else (retries, timeouts) is kept, and
        so are the cap and prices when the block leaves them empty (a block never silently removes a cap)."""
        fields: dict[str, Any] = base.model_dump() if base is not None else {}
        fields.update(
            kind=self.kind,
            base_url=self.base_url,
            model=self.model,
            api_key=self.api_key,
            api_key_env=None,
            max_in_flight=self.max_in_flight,
            provider_routing=self.provider_routing,
            reasoning=self.reasoning,
            stream=self.stream,
        )
        if self.stream is None:  # the YAML's choice for the same kind, else the kind's default
            if base is not None and base.kind == self.kind:
                fields["stream"] = base.stream
            else:
                fields.pop("stream")
        optional = {
            "max_cost_usd": self.max_cost_usd,
            "price_prompt_usd_per_mtok": self.price_prompt_usd_per_mtok,
            "price_completion_usd_per_mtok": self.price_completion_usd_per_mtok,
        }
        fields.update({k: v for k, v in optional.items() if v is not None})
        return EndpointConfig.model_validate(fields)
