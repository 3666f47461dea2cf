"""Flow-run names say which flow and run directory a run is (`pipeline-<run dir>-<6 hex>`), and the extraction run
the pipeline starts on the GPU pool says whose it is (`extract-<run dir>-for-<pipeline run>`): a UI probe found
every run under Prefect's random names ("myrtle-squid", its subflow "glossy-wapiti", its extraction "meek-turtle")."""

from __future__ import annotations

import uuid
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from flows.cli import demo_config_path
from flows.params import RunParameters, resolve_run
from flows.run_names import flow_run_name, handoff_name, run_dir_label, run_name

RUN_ID = uuid.UUID("0190f4c2-1d2e-7a3b-9c4d-5e6f7a8b9c0d")


def _form(tmp_path: Path, **overrides: Any) -> RunParameters:
    return RunParameters(
        config_path=str(demo_config_path()), overrides={"run_dir": str(tmp_path / "nightly"), **overrides}
    )


def test_the_name_is_flow_run_dir_and_the_end_of_the_run_id(tmp_path: Path) -> None:
    form = _form(tmp_path)
    assert run_name("eagle3-pipeline", {"run": form}, RUN_ID) == "pipeline-nightly-8b9c0d"
    # as a deployment run's parameters arrive, and as the shipped YAML sets it (relative to the YAML file)
    assert run_name("eagle3-generate", {"run": form.model_dump(mode="json")}, RUN_ID) == "generate-nightly-8b9c0d"
    shipped = RunParameters(config_path=str(demo_config_path()))
    assert run_dir_label({"run": shipped}) == resolve_run(shipped).cfg.run_dir.name
    inline = RunParameters(config={"run_dir": "/data/runs/kimi-0412"}, overrides={})
    assert run_dir_label({"run": inline}) == "kimi-0412"
    assert run_dir_label({"cfg": resolve_run(form).cfg, "parts": [0]}) == "nightly"


def test_a_form_that_does_not_resolve_gets_a_plain_name_and_never_an_error(tmp_path: Path) -> None:
    missing = RunParameters(config_path=str(tmp_path / "no-such.yaml"))
    assert run_name("eagle3-pipeline", {"run": missing}, RUN_ID) == "pipeline-8b9c0d"
    assert run_name("eagle3-pipeline", {"run": {"config_path": 3, "junk": True}}, RUN_ID) == "pipeline-8b9c0d"
    assert run_name("eagle3-pipeline", {}, RUN_ID) == "pipeline-8b9c0d"
    two = {run_name("eagle3-pipeline", {"run": missing}, None) for _ in range(20)}
    assert len(two) == 20, "without a run id the tail is random"


def test_a_name_the_pipeline_gave_its_extraction_run_is_kept(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Prefect calls a flow's flow_run_name for a deployment run too, and would replace the name run_deployment
    set; the extraction flow keeps it, and names a run of its own (the UI's Run on extract-gpu) itself."""
    from prefect.context import FlowRunContext

    given = handoff_name("nightly", "pipeline-nightly-8b9c0d")
    assert given == "extract-nightly-for-pipeline-nightly-8b9c0d"

    def context(name: str) -> SimpleNamespace:
        return SimpleNamespace(
            flow=SimpleNamespace(name="eagle3-extract"),
            flow_run=SimpleNamespace(name=name, id=RUN_ID),
            parameters={"run": _form(tmp_path)},
        )

    monkeypatch.setattr(FlowRunContext, "get", classmethod(lambda cls: context(given)))
    assert flow_run_name() == given
    monkeypatch.setattr(FlowRunContext, "get", classmethod(lambda cls: context("meek-turtle")))
    assert flow_run_name() == "extract-nightly-8b9c0d"


@pytest.mark.usefixtures("prefect_harness")
def test_runs_subflows_and_the_extraction_hand_off_are_named_after_their_run_directory(
    tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from prefect.client.orchestration import get_client

    import flows.extract_handoff as handoff
    import flows.pipeline as pipeline_module

    names: dict[str, str] = {}

    class Handed(Exception):
        pass

    def deployment_run(name: str, **kwargs: Any) -> Any:
        names["extract"] = kwargs["flow_run_name"]
        raise Handed

    def stages(cfg: Any, store: Any, run: Any) -> dict[str, Any]:
        from prefect.runtime import flow_run

        names["pipeline"] = str(flow_run.name)
        subflow = pipeline_module.cpu_stages_flow(cfg, [], return_state=True)
        with get_client(sync_client=True) as client:
            cpu_id = subflow.state_details.flow_run_id
        assert cpu_id is not None
        names["cpu"] = client.read_flow_run(cpu_id).name
        with pytest.raises(Handed):
            handoff.extract_on_deployment(run.model_copy(update={"extract_deployment": "eagle3-extract/x"}), "nightly")
        return {"run_dir": str(cfg.run_dir)}

    monkeypatch.setattr(pipeline_module, "run_pipeline", stages)
    monkeypatch.setattr(handoff, "run_deployment", deployment_run)
    state = pipeline_module.pipeline(_form(tmp_path, **{"tokenizer.path": str(tiny_model_dir)}), return_state=True)
    assert state.is_completed(), state.message
    run_id = state.state_details.flow_run_id
    assert run_id is not None
    with get_client(sync_client=True) as client:
        stored = client.read_flow_run(run_id).name
    assert stored == names["pipeline"] == f"pipeline-nightly-{run_id.hex[-6:]}"
    assert names["cpu"].startswith("cpu-stages-nightly-") and names["cpu"] != stored
    assert names["extract"] == f"extract-nightly-for-{stored}"


def test_the_train_and_evaluate_flows_are_named_after_their_run_directory() -> None:
    """`eagle3-train` runs (the train-gpu deployment) were listed under Prefect's random names."""
    from flows.train_flow import evaluate_flow, train_flow

    assert train_flow.flow_run_name is flow_run_name and evaluate_flow.flow_run_name is flow_run_name
    assert run_name("eagle3-train", {"run_dir": "runs/nope", "evaluate": True}, RUN_ID) == "train-nope-8b9c0d"
    assert run_name("eagle3-evaluate", {"run_dir": "/runs/run"}, RUN_ID) == "evaluate-run-8b9c0d"


def test_the_train_and_evaluate_run_forms_describe_every_field() -> None:
    """The train-gpu deployment's Run form showed bare labels (`run_dir`, `out_dir (Optional)`) where the
    pipeline's form explains each field (a UI probe)."""
    from prefect.utilities.callables import parameter_schema

    from flows.train_flow import evaluate_flow, train_flow

    for flow_obj in (train_flow, evaluate_flow):
        fields = parameter_schema(flow_obj).model_dump_for_openapi()["properties"]
        bare = [name for name, spec in fields.items() if not spec.get("description")]
        assert fields and not bare, (flow_obj.name, bare)
