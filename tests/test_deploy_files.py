"""Deployment files validated with the tools' own models: Prefect's prefect.yaml and automation schemas, the
Compose specification's JSON schema (tests/schemas/compose_spec.json, from the docker-compose 1.29.2 wheel), and
hadolint for the Dockerfiles (`make lint`)."""

from __future__ import annotations

import importlib
import json
import sys
import uuid
from pathlib import Path
from typing import Any

import jsonschema
import yaml
from prefect.cli.deploy._models import PrefectYamlModel

from tasks.common.config import load_config

REPO = Path(__file__).resolve().parents[1]


def _load(path: str) -> Any:
    return yaml.safe_load((REPO / path).read_text())


def test_prefect_yaml_parses_with_prefects_model_and_parameters_match_the_flows() -> None:
    from flows.params import RunParameters

    spec = PrefectYamlModel.model_validate(_load("deployments/prefect.yaml"))
    pools = {}
    for deployment in spec.deployments:
        assert deployment.entrypoint and deployment.work_pool and deployment.name
        module_path, func = deployment.entrypoint.split(":")
        flow_obj = getattr(importlib.import_module(module_path.removesuffix(".py").replace("/", ".")), func)
        pools[deployment.name] = (deployment.work_pool.name, deployment.concurrency_limit)
        if deployment.name == "train-gpu":  # run_dir is given per run; every flow parameter has a name it knows
            assert set(deployment.parameters or {}) <= set(flow_obj.parameters.properties)
            assert "run_dir" in flow_obj.parameters.required
            continue
        assert set(deployment.parameters) == set(flow_obj.parameters.properties) == {"run"}
        RunParameters.model_validate(deployment.parameters["run"])
    assert pools == {  # pipeline and nightly-rerun share one global limit instead (deployments/setup.sh)
        "pipeline": ("eagle3-cpu", None),
        "extract-gpu": ("eagle3-gpu", 1),
        "train-gpu": ("eagle3-gpu", 1),
        "nightly-rerun": ("eagle3-cpu", None),
    }
    assert "python deployments/run_dir_concurrency.py" in (REPO / "deployments" / "setup.sh").read_text()
    nightly = next(d for d in spec.deployments if d.name == "nightly-rerun")
    assert nightly.schedules and nightly.schedules[0].model_dump(exclude_none=True)["cron"] == "0 2 * * *"
    assert all(s.model_dump()["active"] is False for s in nightly.schedules), "schedules ship paused"
    for deployment in spec.deployments:  # what the Run button runs must be in the repository and load
        if deployment.name == "train-gpu":  # trains on the run directory the shipped config writes
            shipped = load_config(REPO / "configs" / "run.yaml")
            assert (REPO / deployment.parameters["run_dir"]).resolve() == Path(shipped.run_dir).resolve()
            continue
        config_path = REPO / deployment.parameters["run"]["config_path"]
        assert config_path.is_file(), f"{deployment.name}: {config_path} is not in the repository"
        load_config(config_path)


def test_the_s3_extra_and_the_moto_test_server_are_declared() -> None:
    import tomllib

    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert any(dep.startswith("s3fs") for dep in extras["s3"])
    assert any(dep.startswith("moto[server]") for dep in extras["dev"])


def test_automations_parse_with_prefects_model() -> None:
    sys.path.insert(0, str(REPO / "deployments"))
    try:
        from create_automations import load_automations
    finally:
        sys.path.pop(0)
    block_id = str(uuid.uuid4())
    automations = load_automations(REPO / "deployments" / "automations.yaml", block_id)
    assert [a.name for a in automations] == [
        "eagle3 run crashed when its heartbeats stopped",
        "eagle3 flow run failed",
        "eagle3 run stopped at its cost cap",
        "eagle3 gpu pool has no worker",
    ]
    assert all(str(a.actions[0].model_dump()["block_document_id"]) == block_id for a in automations[1:])
    without_block = load_automations(REPO / "deployments" / "automations.yaml", None)
    assert [a.name for a in without_block] == ["eagle3 run crashed when its heartbeats stopped"]


def test_every_deployment_sends_heartbeats_the_crash_automation_waits_three_of() -> None:
    """Prefect 3.9's zombie-flow automation: after a heartbeat, any event of the same run within `within`
    seconds, else the run is marked Crashed; limited to eagle3 runs, whose heartbeats come every 30 s."""
    from prefect.client.schemas.objects import StateType
    from prefect.events.actions import ChangeFlowRunState
    from prefect.events.schemas.automations import EventTrigger, Posture
    from prefect.server.events.schemas.automations import EventTrigger as ServerEventTrigger

    sys.path.insert(0, str(REPO / "deployments"))
    try:
        from create_automations import load_automations
    finally:
        sys.path.pop(0)
    [crash] = load_automations(REPO / "deployments" / "automations.yaml", None)
    trigger, [action] = crash.trigger, crash.actions
    assert isinstance(trigger, EventTrigger) and isinstance(action, ChangeFlowRunState)
    assert trigger.posture == Posture.Proactive and trigger.for_each == {"prefect.resource.id"}
    assert trigger.after == {"prefect.flow-run.heartbeat"}
    served = ServerEventTrigger.model_validate(trigger.model_dump())  # the server's model decides what matches
    assert served.expects("prefect.flow-run.heartbeat") and served.expects("prefect.flow-run.BudgetStopped")
    tag = {"prefect.resource.id": "prefect.tag.eagle3", "prefect.resource.role": "tag"}
    assert trigger.match_related.model_dump() == tag
    assert action.state == StateType.CRASHED
    spec = _load("deployments/prefect.yaml")
    for deployment in spec["deployments"]:
        assert "eagle3" in deployment["tags"], deployment["name"]
        frequency = int(deployment["work_pool"]["job_variables"]["env"]["PREFECT_FLOWS_HEARTBEAT_FREQUENCY"])
        assert frequency >= 30 and trigger.within.total_seconds() >= 3 * frequency, deployment["name"]


def test_compose_file_matches_the_compose_spec_and_wires_gpu_and_shared_volume() -> None:
    schema = json.loads((REPO / "tests" / "schemas" / "compose_spec.json").read_text())
    compose = _load("docker/compose.yaml")
    jsonschema.validate(compose, schema)
    services = compose["services"]
    assert set(services) == {"postgres", "prefect-server", "cpu-worker", "gpu-worker"}
    gpu = services["gpu-worker"]["deploy"]["resources"]["reservations"]["devices"][0]
    assert gpu["capabilities"] == ["gpu"]
    assert "runs:/runs" in services["cpu-worker"]["volumes"] and "runs:/runs" in services["gpu-worker"]["volumes"]
    assert "postgresql+asyncpg" in services["prefect-server"]["environment"]["PREFECT_API_DATABASE_CONNECTION_URL"]
    for name in ("cpu-worker", "gpu-worker"):
        dockerfile = (REPO / "docker" / Path(services[name]["build"]["dockerfile"]).name).read_text()
        pool = "eagle3-cpu" if name == "cpu-worker" else "eagle3-gpu"
        assert f'"--pool", "{pool}"' in dockerfile


def test_both_images_carry_what_the_deployments_run_and_the_demo_blocks_use_the_shared_volume() -> None:
    """configs/run.yaml (every shipped deployment's config_path) must be inside both worker images, and the demo
    blocks' run directory must be the volume both workers mount, not a folder inside one container."""
    spec = PrefectYamlModel.model_validate(_load("deployments/prefect.yaml"))
    compose = _load("docker/compose.yaml")["services"]
    paths = {d.parameters["run"]["config_path"] for d in spec.deployments if "run" in (d.parameters or {})}
    for name in ("cpu-worker", "gpu-worker"):
        dockerfile = (REPO / "docker" / Path(compose[name]["build"]["dockerfile"]).name).read_text()
        copied = {line.split()[1] for line in dockerfile.splitlines() if line.startswith("COPY ")}
        for path in paths:
            assert path.split("/")[0] in copied, f"{name}: {path} is not in the image"
        assert "EAGLE3_DEMO_RUNS_DIR=/runs" in dockerfile, name
        assert "runs:/runs" in compose[name]["volumes"], name
    assert '--runs-dir "${EAGLE3_DEMO_RUNS_DIR:-runs}"' in (REPO / "deployments" / "setup.sh").read_text()
