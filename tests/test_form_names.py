"""Names typed into the run form that the server does not hold (a block, the extraction deployment) are refused
before the run sends anything, in one line that names what is there, and the failure-summary keeps its run
directory's key (a UI probe: generation was paid for before `ObjectNotFound: None`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from flows.cli import demo_config_path
from flows.params import RunParameters, resolve_run
from tasks.common.errors import ConfigError


def _form(run_dir: Path, **fields: Any) -> RunParameters:
    overrides = {"run_dir": str(run_dir), "tokenizer.path": str(run_dir / "tok")}
    return RunParameters(config_path=str(demo_config_path()), overrides=overrides, **fields)


@pytest.mark.usefixtures("prefect_harness")
@pytest.mark.parametrize("field", ["endpoint_block", "backend_block"])
def test_a_block_the_server_does_not_hold_is_one_config_error_naming_the_saved_ones(tmp_path: Path, field: str) -> None:
    from blocks import HiddenStateBackendBlock, InferenceEndpointBlock

    InferenceEndpointBlock(base_url="http://127.0.0.1:9", model="m").save("names-endpoint", overwrite=True)
    HiddenStateBackendBlock().save("names-backend", overwrite=True)
    with pytest.raises(ConfigError) as refused:
        resolve_run(_form(tmp_path / "run", **{field: "nope-block"}))
    line = str(refused.value)
    assert line.startswith(f"{field} 'nope-block': no such block; saved: ") and "\n" not in line
    assert ("names-endpoint" in line) == (field == "endpoint_block")
    assert ("names-backend" in line) == (field == "backend_block")


@pytest.mark.usefixtures("prefect_harness")
@pytest.mark.parametrize(
    "fields, says",
    [
        ({"extract_deployment": "eagle3-extract/nope"}, "extract_deployment 'eagle3-extract/nope': no such deployment"),
        ({"extract_deployment": "nope"}, "extract_deployment 'nope': no such deployment"),
        ({"endpoint_block": "nope-block"}, "endpoint_block 'nope-block': no such block"),
    ],
)
def test_a_run_naming_what_the_server_lacks_stops_before_prepare_under_its_run_dirs_key(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fields: dict[str, Any], says: str
) -> None:
    from prefect.artifacts import Artifact

    import flows.pipeline as pipeline_module

    started: list[Any] = []
    monkeypatch.setattr(pipeline_module, "run_pipeline", lambda *args: started.append(args))
    state = pipeline_module.pipeline(_form(tmp_path / "typo-run", **fields), return_state=True)
    assert state.is_failed() and not started
    assert says in (state.message or ""), state.message
    summary = Artifact.get("failure-summary-typo-run")
    assert summary is not None and summary.flow_run_id == state.state_details.flow_run_id
