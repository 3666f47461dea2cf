from __future__ import annotations

import pytest

from blocks.endpoint import InferenceEndpointBlock
from tasks.common.config import EndpointConfig


@pytest.mark.usefixtures("prefect_harness")
def test_endpoint_block_round_trips_through_the_server_and_keeps_the_key_secret() -> None:
    InferenceEndpointBlock(
        kind="openai_chat",
        base_url="https://openrouter.ai/api",
        model="moonshotai/kimi-k2.5",
        api_key="sk-or-BLOCK-SECRET",
        max_in_flight=1500,
        provider_routing={"only": ["moonshotai"]},
    ).save("test-endpoint", overwrite=True)
    loaded = InferenceEndpointBlock.load("test-endpoint")
    assert "BLOCK-SECRET" not in repr(loaded)
    base = EndpointConfig(model="yaml-model", max_attempts=9, price_completion_usd_per_mtok=2.5)
    cfg = loaded.to_endpoint_config(base)
    assert cfg.model == "moonshotai/kimi-k2.5"
    assert cfg.max_in_flight == 1500
    assert cfg.max_attempts == 9
    assert cfg.price_completion_usd_per_mtok == 2.5
    assert cfg.resolved_api_key() == "sk-or-BLOCK-SECRET"
    assert "BLOCK-SECRET" not in cfg.model_dump_json()
    assert cfg.max_cost_usd is None


def test_endpoint_block_sets_a_budget_but_never_removes_the_yaml_one() -> None:
    base = EndpointConfig(
        model="m", max_cost_usd=40.0, price_prompt_usd_per_mtok=0.6, price_completion_usd_per_mtok=2.5
    )
    common = {"base_url": "https://openrouter.ai/api", "model": "moonshotai/kimi-k2.5"}
    kept = InferenceEndpointBlock(**common).to_endpoint_config(base)
    assert (kept.max_cost_usd, kept.price_prompt_usd_per_mtok, kept.price_completion_usd_per_mtok) == (40.0, 0.6, 2.5)
    block = InferenceEndpointBlock(
        **common,
        max_cost_usd=90.0,
        price_completion_usd_per_mtok=3.0,
        stream=True,
        reasoning={"effort": "high"},
        provider_routing={"order": ["moonshotai"], "quantizations": ["int4"], "allow_fallbacks": False},
    )
    cfg = block.to_endpoint_config(base)
    assert (cfg.max_cost_usd, cfg.price_prompt_usd_per_mtok, cfg.price_completion_usd_per_mtok) == (90.0, 0.6, 3.0)
    assert cfg.stream and cfg.reasoning == {"effort": "high"}
    assert cfg.provider_routing == {"order": ["moonshotai"], "quantizations": ["int4"], "allow_fallbacks": False}


def test_tokenizer_and_backend_blocks_convert_to_the_strict_config_sections() -> None:
    from blocks import HiddenStateBackendBlock, TokenizerSourceBlock
    from tasks.common.config import ExtractConfig

    tok = TokenizerSourceBlock(
        path="/models/Kimi-K2.5",
        trust_remote_code=True,
        completion_format="kimi_k2_thinking",
        chat_template_kwargs={"thinking": True},
    ).to_tokenizer_config()
    assert (str(tok.path), tok.trust_remote_code, tok.completion_format) == (
        "/models/Kimi-K2.5",
        True,
        "kimi_k2_thinking",
    )
    assert tok.chat_template_kwargs == {"thinking": True}
    written = {"name": "smollm3_thinking", "reasoning_open": "<think>", "reasoning_close": "</think>"}
    smol = TokenizerSourceBlock(path="/models/SmolLM3-3B", completion_format={**written, "end_of_turn": "<|im_end|>"})
    assert smol.to_tokenizer_config().completion_format_name == "smollm3_thinking"
    with pytest.raises(ValueError, match="end_of_turn"):
        TokenizerSourceBlock(path="/models/SmolLM3-3B", completion_format=written).to_tokenizer_config()
    base = ExtractConfig(max_shard_bytes=4096, skip_failed_validation=False)
    ext = HiddenStateBackendBlock(backend="sglang", device="cuda", layers=[2, 30, 57], tp_size=8).to_extract_config(
        base
    )
    assert (ext.backend, ext.device, ext.layers, ext.max_shard_bytes) == ("sglang", "cuda", [2, 30, 57], 4096)
    assert ext.tp_size == 8
    assert ext.skip_failed_validation is False
