from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from flows.params import RunParameters, in_slice, resolve_run

INLINE = {
    "run_dir": "/tmp/eagle3-params-test",
    "datasets": [{"name": "B1", "path": "/tmp/b1.jsonl"}],
    "endpoint": {"model": "m", "api_key_env": "OPENROUTER_API_KEY"},
    "tokenizer": {"path": "/models/x"},
}


def test_inline_config_with_overrides_resolves_to_the_strict_config() -> None:
    resolved = resolve_run(RunParameters(config=INLINE, overrides={"endpoint.max_in_flight": 64}))
    assert resolved.cfg.endpoint.max_in_flight == 64
    assert resolved.cfg.run_dir == Path("/tmp/eagle3-params-test")
    assert resolved.store is None


@pytest.mark.parametrize(
    "params, message",
    [
        ({}, "exactly one"),
        ({"config_path": "a.yaml", "config": INLINE}, "exactly one"),
        ({"config": {**INLINE, "endpoint": {"model": "m", "api_key": "sk-x"}}}, "must not carry endpoint.api_key"),
        ({"config_path": "a.yaml", "overrides": {"endpoint.api_key": "sk-x"}}, "must not carry endpoint.api_key"),
        # a whole section as one override (an independent UI probe: it reached the flow run's parameters)
        ({"config_path": "a.yaml", "overrides": {"endpoint": {"model": "m", "api_key": "sk-x"}}}, "must not carry"),
        ({"config": INLINE, "overrides": {"endpoint": {"model": "m", "api_key": "sk-x"}}}, "must not carry"),
        ({"config_path": "a.yaml", "overrides": {"endpoint": "x", "endpoint.model": "m"}}, "is not a section"),
        ({"config_path": "a.yaml", "part_slice": "8/8"}, "index must be < count"),
        ({"config_path": "a.yaml", "part_slice": "1-8"}, "pattern"),
        ({"config_path": "a.yaml", "surprise": 1}, "surprise"),
    ],
)
def test_run_form_rejects(params: dict[str, object], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        RunParameters.model_validate(params)


@pytest.mark.usefixtures("prefect_harness")
def test_the_run_forms_overrides_win_over_the_blocks(tmp_path: Path) -> None:
    """A block replaces its whole section; the form's overrides (its own example is endpoint.max_in_flight) used
    to be dropped under it without a word."""
    from blocks import ArtifactStoreBlock, InferenceEndpointBlock, TokenizerSourceBlock

    InferenceEndpointBlock(base_url="http://127.0.0.1:9", model="block-model", max_in_flight=64).save(
        "params-endpoint", overwrite=True
    )
    TokenizerSourceBlock(path="/models/block-tokenizer").save("params-tokenizer", overwrite=True)
    overrides = {"endpoint.max_in_flight": 8, "tokenizer.chat_template_kwargs": {"thinking": True}}
    resolved = resolve_run(
        RunParameters(
            config=INLINE, overrides=overrides, endpoint_block="params-endpoint", tokenizer_block="params-tokenizer"
        )
    )
    ep, tok = resolved.cfg.endpoint, resolved.cfg.tokenizer
    assert (ep.model, ep.base_url, ep.max_in_flight) == ("block-model", "http://127.0.0.1:9", 8)
    assert (tok.path, tok.chat_template_kwargs) == (Path("/models/block-tokenizer"), {"thinking": True})
    plain = resolve_run(RunParameters(config=INLINE, endpoint_block="params-endpoint")).cfg.endpoint
    assert plain.max_in_flight == 64

    # An overridden run_dir names the run inside the store block's location, local or not.
    ArtifactStoreBlock(location=str(tmp_path / "runs")).save("params-store", overwrite=True)
    stored = resolve_run(
        RunParameters(config=INLINE, overrides={"run_dir": "nightly", **overrides}, artifact_store_block="params-store")
    )
    assert stored.cfg.run_dir == tmp_path / "runs" / "nightly" and stored.cfg.endpoint.max_in_flight == 8


def test_part_slices_partition_the_parts() -> None:
    slices = [[p for p in range(20) if in_slice(p, f"{i}/8")] for i in range(8)]
    assert sorted(p for s in slices for p in s) == list(range(20))
    assert slices[3] == [3, 11, 19]
    assert [p for p in range(3) if in_slice(p, None)] == [0, 1, 2]


@pytest.mark.parametrize(
    "params",
    [
        {"config_path": "a.yaml", "overrides": {"endpoint.api_key": "sk-typed-KEY"}},
        {"config_path": "a.yaml", "overrides": {"endpoint.API_KEY": "sk-typed-KEY"}},
        {"config_path": "a.yaml", "overrides": {"endpoint.api_key ": "sk-typed-KEY"}},
        {"config_path": "a.yaml", "overrides": {"endpoint": {"model": "m", "api_key": "sk-typed-KEY"}}},
        {"config_path": "a.yaml", "overrides": {"Endpoint": {"api_key": "sk-typed-KEY"}}},
        {"config_path": "a.yaml", "overrides": {"ENDPOINT": {"api_key": "sk-typed-KEY"}}},
        {"config_path": "a.yaml", "overrides": {"endpoint.key": "sk-typed-KEY"}},
        {"config_path": "a.yaml", "overrides": {"endpoint.api_token": "sk-typed-KEY"}},
        {"config": {**INLINE, "endpoint": {"model": "m", "api_key": "sk-typed-KEY"}}},
        {"config": {**INLINE, "endpoint": {"model": "m", "Api-Key": "sk-typed-KEY"}}},
        {"config": {**INLINE, "endpoint.api_key": "sk-typed-KEY"}},
        {"config": {**INLINE, "Endpoint ": {"api_key": "sk-typed-KEY"}}},
    ],
)
def test_the_prefect_server_refuses_a_key_in_the_run_form_before_storing_it(params: dict[str, object]) -> None:
    """The deployments enforce their parameter schema on the server, before the run is written to its database;
    the model's own check ran only in the flow, after a key typed into the form was stored and shown on the run's
    Parameters tab. Checked with the validator the server calls, on the schema `prefect deploy` records. The schema
    has no `properties` for these fields: the UI's form rendered those as an "Endpoint" sub-field whose input
    replaced the whole endpoint section."""
    from prefect.utilities.callables import parameter_schema
    from prefect.utilities.schema_tools import validate
    from prefect.utilities.schema_tools.validation import ValidationError as SchemaError

    from flows.pipeline import pipeline

    schema = parameter_schema(pipeline).model_dump_for_openapi()
    with pytest.raises(SchemaError) as refused:
        validate({"run": params}, schema, raise_on_error=True)
    assert "typed-KEY" not in str(refused.value)
    fine = {
        **params,
        "overrides": {
            "endpoint.max_in_flight": 8,
            "endpoint.api_key_env": "OPENROUTER_API_KEY",
            "endpoint.provider_routing.order": ["a"],
            "tokenizer.completion_format.end_of_turn": "<|im_end|>",
            "sampling": {"max_tokens": 64},
            "run_dir": "runs/x",
        },
    }
    if "config" in fine:
        fine["config"] = INLINE
    assert validate({"run": fine}, schema, raise_on_error=True) == []
    fields = schema["definitions"]["RunParameters"]["properties"]
    assert "properties" not in fields["overrides"] and "properties" not in fields["config"]


@pytest.mark.parametrize(
    "overrides, says",
    [
        ({"endpoint.api_key": "sk-typed-KEY"}, "'endpoint.api_key' should not be valid under {'enum': ['endpoint', "),
        ({"endpoint": {"api_key": "sk-typed-KEY"}}, "'endpoint' should not be valid under {'enum': ['endpoint', "),
        ({"endpoint.max_inflight": 8}, "'endpoint.max_inflight' is not one of ['datasets', "),
        ({"Endpoint": {"api_key": "sk-typed-KEY"}}, "'Endpoint' is not one of ['datasets', "),
    ],
)
def test_the_servers_refusal_of_an_override_name_is_readable(overrides: dict[str, object], says: str) -> None:
    """A UI probe was shown a raw regular expression (rendered partly as a markdown link) for `endpoint.api_key`,
    and "is not valid under any of the given schemas" for a typo, without the names it could have meant."""
    from prefect.utilities.callables import parameter_schema
    from prefect.utilities.schema_tools import validate
    from prefect.utilities.schema_tools.validation import ValidationError as SchemaError

    from flows.pipeline import pipeline

    schema = parameter_schema(pipeline).model_dump_for_openapi()
    with pytest.raises(SchemaError) as refused:
        validate({"run": {"config_path": "a.yaml", "overrides": overrides}}, schema, raise_on_error=True)
    message = str(refused.value)
    assert says in message and "[Aa]" not in message and "any of the given schemas" not in message
    if "not one of" in message:
        assert "'endpoint.max_in_flight'" in message and "'endpoint.api_key'" not in message
