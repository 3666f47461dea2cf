"""Flow parameters as one pydantic model, so the Prefect UI renders a validated run form, and the resolution of
that form (YAML or inline config, overrides, block names) into the strict `PipelineConfig` the stages use.

Secrets never travel as parameters: an inline config carrying `endpoint.api_key` is refused, because Prefect
stores flow-run parameters in its database; keys come from an InferenceEndpointBlock or an environment variable.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from types import UnionType
from typing import Any, Literal, Union, cast, get_args, get_origin

from prefect.exceptions import ObjectNotFound
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from blocks.artifact_store import ArtifactStoreBlock
from blocks.backend import HiddenStateBackendBlock
from blocks.endpoint import InferenceEndpointBlock
from blocks.tokenizer import TokenizerSourceBlock
from flows.exit_codes import config_error_line
from tasks.common.artifact_store import RunStore
from tasks.common.config import PipelineConfig, apply_overrides, load_config
from tasks.common.errors import ConfigError

# JSON Schema the Prefect server checks a run's parameters against before it stores them (the deployments set
# `enforce_parameter_schema`): the model validator below runs only in the flow, after the server had already
# written a key typed into the Run form to its database and shown it on the run's Parameters tab. On property
# names only, so the refusal the server returns does not quote the key; and without `properties`, which the UI's
# form renders as sub-fields (an "Endpoint" field under Overrides replaced the whole endpoint section). Names are
# checked against the list of those allowed (`enum`), not refused by pattern: the server's message then lists the
# valid names, where a refused pattern showed the user a raw regular expression (which the UI rendered partly as a
# link) and a typo got "is not valid under any of the given schemas". Patterns are portable (no inline flags), as
# the browser checks them too.
_KEY_LIKE = r"[Aa][Pp][Ii][_-]?[Kk][Ee][Yy](?![_-]?[Ee][Nn][Vv])"
"""`api_key`, `API_KEY`, `api-key`, but not `api_key_env` (the name of an environment variable)"""
_SECRET = "endpoint.api_key"
_ENDPOINT = "endpoint"


def _config_paths(model: type[BaseModel], prefix: str = "") -> tuple[list[str], list[str]]:
    """Every dotted name an override can set (a section, a field of one), and the fields that are free-form
    mappings (`endpoint.provider_routing`), whose own keys follow them."""
    names: list[str] = []
    mappings: list[str] = []
    for name, field in model.model_fields.items():
        path = f"{prefix}{name}"
        names.append(path)
        args = get_args(field.annotation) if get_origin(field.annotation) in (Union, UnionType) else ()
        for kind in args or (field.annotation,):
            if isinstance(kind, type) and issubclass(kind, BaseModel):
                sub_names, sub_mappings = _config_paths(kind, f"{path}.")
                names += sub_names
                mappings += sub_mappings
            elif kind is dict or get_origin(kind) is dict:
                mappings.append(path)
    return sorted(set(names)), sorted(set(mappings))


def _override_names_schema() -> dict[str, Any]:
    """The secret first, so its refusal names it; then a mapping's own keys (free, but never key-like) or one
    of the config's names less the secret and the whole endpoint section (which replaces the block's)."""
    names, mappings = _config_paths(PipelineConfig)
    free = "|".join(re.escape(path) for path in mappings)
    return {
        "allOf": [
            {"not": {"enum": [_ENDPOINT, _SECRET]}},
            {
                "if": {"pattern": f"^({free})\\..+$"},
                "then": {"not": {"pattern": _KEY_LIKE}},
                "else": {"enum": [n for n in names if n not in (_ENDPOINT, _SECRET)]},
            },
        ]
    }


def _config_names_schema() -> dict[str, Any]:
    """An inline config's section names, and its endpoint section's field names less the secret."""
    names, _ = _config_paths(PipelineConfig)
    endpoint = [n.removeprefix(f"{_ENDPOINT}.") for n in names if n.startswith(f"{_ENDPOINT}.") and n != _SECRET]
    return {
        "propertyNames": {"enum": [n for n in names if "." not in n]},
        "patternProperties": {
            f"^{_ENDPOINT}$": {"propertyNames": {"enum": [n for n in endpoint if "." not in n]}},
            **_RUN_DIR_TYPED,
        },
    }


_RUN_DIR_TYPED: dict[str, Any] = {"^run_dir$": {"type": "string", "minLength": 1}}
"""`{"run_dir": 5}` passed the form and failed only in the flow; the run's name and artifact keys need it too."""
_NO_KEY_IN_OVERRIDES: dict[str, Any] = {"propertyNames": _override_names_schema(), "patternProperties": _RUN_DIR_TYPED}
_NO_KEY_IN_CONFIG: dict[str, Any] = _config_names_schema()


class RunParameters(BaseModel):
    model_config = ConfigDict(extra="forbid", hide_input_in_errors=True)

    config_path: str | None = Field(default=None, description="YAML config file, as seen from the worker.")
    config: dict[str, Any] | None = Field(
        default=None,
        description="Inline config (same keys as the YAML). API keys must come from a block or env.",
        json_schema_extra=_NO_KEY_IN_CONFIG,
    )
    overrides: dict[str, Any] = Field(
        default_factory=dict,
        description="Dotted keys, e.g. {'endpoint.max_in_flight': 500}; they win over the YAML and the blocks.",
        json_schema_extra=_NO_KEY_IN_OVERRIDES,
    )
    endpoint_block: str | None = Field(default=None, description="InferenceEndpointBlock name (holds the API key).")
    tokenizer_block: str | None = Field(default=None, description="TokenizerSourceBlock name.")
    artifact_store_block: str | None = Field(default=None, description="ArtifactStoreBlock name (shared run dirs).")
    backend_block: str | None = Field(default=None, description="HiddenStateBackendBlock name (GPU stage).")
    cpu_task_runner: Literal["threads", "dask"] = Field(
        default="threads", description="Runner for per-part CPU stages (reconstruct, validate)."
    )
    dask_workers: int = Field(default=2, ge=1, le=512, description="Local Dask worker processes when 'dask'.")
    part_slice: str | None = Field(
        default=None,
        pattern=r"^[0-9]+/[1-9][0-9]*$",
        description="'i/n': only parts with part % n == i, to split extraction across n GPU hosts.",
    )
    extract_deployment: str | None = Field(
        default=None,
        description="Run extraction as this deployment (e.g. 'eagle3-extract/extract-gpu', on the GPU pool) "
        "and wait for it, instead of in this process.",
    )
    extract_worker_wait_s: float = Field(
        default=900.0,
        ge=0,
        description="With extract_deployment: how long the extraction run may wait for a worker on its pool when "
        "none is polling it; then the run is cancelled and the pipeline fails saying so (logged at once).",
    )
    dry_run: bool = Field(
        default=False,
        description="Prepare and estimate only: log what the run would send, cost and take, then stop "
        "without sending a request.",
    )

    @model_validator(mode="after")
    def _one_config(self) -> RunParameters:
        if (self.config_path is None) == (self.config is None):
            raise ValueError("give exactly one of config_path or config")
        endpoint = (self.config or {}).get("endpoint") or {}
        if isinstance(endpoint, dict) and endpoint.get("api_key"):
            raise ValueError("an inline config must not carry endpoint.api_key; use endpoint_block or api_key_env")
        if self.part_slice is not None:
            index, count = (int(x) for x in self.part_slice.split("/"))
            if index >= count:
                raise ValueError(f"part_slice {self.part_slice!r}: index must be < count")
        try:
            merged = apply_overrides({}, self.overrides).get("endpoint")
        except ConfigError as exc:  # an override that is not one: one line, as resolve_run would say
            raise ValueError(str(exc)) from None
        if isinstance(merged, dict) and merged.get("api_key"):  # `endpoint.api_key`, or a whole `endpoint` section
            raise ValueError("overrides must not carry endpoint.api_key; use endpoint_block or api_key_env")
        return self


def in_slice(part: int, part_slice: str | None) -> bool:
    if part_slice is None:
        return True
    index, count = (int(x) for x in part_slice.split("/"))
    return part % count == index


@dataclass(frozen=True)
class ResolvedRun:
    cfg: PipelineConfig
    store: RunStore | None


def _load_block(cls: type[Any], name: str, field: str) -> Any:
    """The saved block `name`; a name the server does not hold is a ConfigError of one line naming the form's
    field and the blocks of that type it does hold (Prefect's own ValueError came with two long tracebacks)."""
    try:
        return cls.load(name)
    except ValueError as exc:
        if not isinstance(exc.__cause__, ObjectNotFound):
            raise
        raise ConfigError(f"{field} {name!r}: no such block; saved: {_saved_blocks(cls)}") from None


def _saved_blocks(cls: type[Any]) -> str:
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        saved = client.read_block_documents_by_type(cls.get_block_type_slug(), include_secrets=False)
    return ", ".join(sorted(doc.name for doc in saved if doc.name and not doc.is_anonymous)) or "none"


def resolve_run(params: RunParameters) -> ResolvedRun:
    """The run's config: the YAML (or the inline mapping) with the form's overrides and the named blocks. An
    invalid one raises a ConfigError of one line (pydantic's own message echoes input values, a key's among them,
    into the flow run's state)."""
    try:
        return _resolve_run(params)
    except ValidationError as exc:
        raise ConfigError(config_error_line(exc)) from None


def _resolve_run(params: RunParameters) -> ResolvedRun:
    if params.config_path is not None:
        cfg = load_config(Path(params.config_path), params.overrides)
    else:
        cfg = PipelineConfig.model_validate(apply_overrides(dict(params.config or {}), params.overrides))
    update: dict[str, Any] = {}
    if params.endpoint_block:
        endpoint = cast(
            InferenceEndpointBlock, _load_block(InferenceEndpointBlock, params.endpoint_block, "endpoint_block")
        )
        update["endpoint"] = endpoint.to_endpoint_config(cfg.endpoint)
    if params.tokenizer_block:
        tokenizer = cast(
            TokenizerSourceBlock, _load_block(TokenizerSourceBlock, params.tokenizer_block, "tokenizer_block")
        )
        update["tokenizer"] = tokenizer.to_tokenizer_config()
    if params.backend_block:
        backend = cast(
            HiddenStateBackendBlock, _load_block(HiddenStateBackendBlock, params.backend_block, "backend_block")
        )
        update["extract"] = backend.to_extract_config(cfg.extract)
    store = None
    if params.artifact_store_block:
        block = cast(
            ArtifactStoreBlock, _load_block(ArtifactStoreBlock, params.artifact_store_block, "artifact_store_block")
        )
        update["run_dir"] = block.local_run_dir(cfg.run_dir.name)
        store = block.run_store(cfg.run_dir.name)
    if update:
        # The run form's overrides are this run's own choices: a block replaces whole sections, so they are put
        # back on top (a block's max_in_flight silently beat the form's). run_dir stays the store's mapping of it.
        again = {k: v for k, v in params.overrides.items() if not (k == "run_dir" and params.artifact_store_block)}
        data = {**cfg.model_dump(), **{k: _dumpable(v) for k, v in update.items()}}
        cfg = PipelineConfig.model_validate(apply_overrides(data, again))
    return ResolvedRun(cfg, store)


def _dumpable(value: Any) -> Any:
    return value.model_dump() if isinstance(value, BaseModel) else value
