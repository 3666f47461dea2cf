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
        ({"config_path": "a.yaml", "part_slice": "8/8"}, "index must be < count"),
        ({"config_path": "a.yaml", "part_slice": "1-8"}, "pattern"),
        ({"config_path": "a.yaml", "surprise": 1}, "surprise"),
    ],
)
def test_run_form_rejects(params: dict[str, object], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        RunParameters.model_validate(params)


def test_part_slices_partition_the_parts() -> None:
    slices = [[p for p in range(20) if in_slice(p, f"{i}/8")] for i in range(8)]
    assert sorted(p for s in slices for p in s) == list(range(20))
    assert slices[3] == [3, 11, 19]
    assert [p for p in range(3) if in_slice(p, None)] == [0, 1, 2]
