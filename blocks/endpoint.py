"""An inference endpoint stored as a Prefect Block, so the API key lives on the server and never in a flow
parameter, a YAML file in git, or a task's inputs. It converts to the same strict `EndpointConfig` the YAML gives."""

from __future__ import annotations

from typing import Any, Literal

from prefect.blocks.core import Block
from pydantic import Field, SecretStr

from tasks.config import EndpointConfig


class InferenceEndpointBlock(Block):
    _block_type_slug = "eagle3-inference-endpoint"
    _block_type_name = "EAGLE-3 Inference Endpoint"
    _description = "OpenAI-compatible or SGLang endpoint the generate stage sends requests to."

    kind: Literal["openai_chat", "sglang_generate"] = "openai_chat"
    base_url: str = Field(description="e.g. https://openrouter.ai/api or http://sglang-host:30000")
    model: str
    api_key: SecretStr | None = None
    max_in_flight: int = Field(default=2000, ge=1)
    provider_routing: dict[str, Any] | None = None

    def to_endpoint_config(self, base: EndpointConfig | None = None) -> EndpointConfig:
        """Block fields win over the YAML's endpoint section; everything else (retries, prices) is kept."""
        fields: dict[str, Any] = base.model_dump() if base is not None else {}
        fields.update(
            kind=self.kind,
            base_url=self.base_url,
            model=self.model,
            api_key=self.api_key,
            api_key_env=None,
            max_in_flight=self.max_in_flight,
            provider_routing=self.provider_routing,
        )
        return EndpointConfig.model_validate(fields)
