from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from blocks.endpoint import InferenceEndpointBlock
from tasks.config import EndpointConfig

REPO = Path(__file__).resolve().parents[1]


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


def test_prefect_yaml_entrypoints_exist() -> None:
    spec = yaml.safe_load((REPO / "deployments" / "prefect.yaml").read_text())
    import importlib

    pools = {}
    for deployment in spec["deployments"]:
        module_path, func = deployment["entrypoint"].split(":")
        module = importlib.import_module(module_path.removesuffix(".py").replace("/", "."))
        flow_obj = getattr(module, func)
        params = set(flow_obj.parameters.properties)
        assert set(deployment["parameters"]) <= params, deployment["name"]
        pools[deployment["name"]] = deployment["work_pool"]["name"]
    assert pools == {"pipeline": "eagle3-cpu", "extract-gpu": "eagle3-gpu"}
