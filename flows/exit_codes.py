"""The one exit-code table every `eagle3-datagen` command uses, and the one-line message for each error a user can
act on. A user error is never a traceback: `--debug` brings it back.

Add a command: return an `ExitCode`, raise a `DatagenError` subclass (or let one through); `flows.cli.main` turns
anything raised into `error_line(exc)` on stderr and `exit_code_for(exc)`. No Prefect import here.
"""

from __future__ import annotations

import errno
import re
from collections.abc import Callable
from enum import IntEnum
from typing import Any

EPHEMERAL_STARTUP_SETTING = "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"
EPHEMERAL_STARTUP_DEFAULT_S = 120
"""Ours, where the environment sets none."""
PREFECT_EPHEMERAL_STARTUP_S = 20
"""Prefect's own, where nothing sets the variable (outside our commands)."""
EPHEMERAL_TIMEOUT_TEXT = "Timed out while attempting to connect to ephemeral Prefect API server"
"""What Prefect 3 raises (a RuntimeError) when the embedded server it starts for a flow run does not answer within
its startup timeout: a loaded machine, not a bug, yet it was reported as an internal error."""


class ExitCode(IntEnum):
    OK = 0
    INTERNAL = 1
    USER = 2
    BUDGET = 3
    ENDPOINT = 4
    GATES = 5
    STAGES_DISAGREE = 6
    PREFECT_SERVER = 7


EXIT_CODE_MEANINGS: dict[ExitCode, str] = {
    ExitCode.OK: "finished (a sample that failed is a row with its reason, not an error)",
    ExitCode.INTERNAL: "internal error: a bug; rerun with --debug and report the traceback",
    ExitCode.USER: "fix the input: config, dataset, tokenizer, run directory, disk space, a failing disk, permissions, "
    "missing outputs",
    ExitCode.BUDGET: "budget: stopped at endpoint.max_cost_usd, or the estimate's low end already exceeds it",
    ExitCode.ENDPOINT: "endpoint unavailable or refusing the run (unreachable, 401/403/404, 402 no credit, "
    "unknown model id)",
    ExitCode.GATES: "validation gates crossed (failed samples or mismatches beyond validation.* limits), or a "
    "provider the target scores worse than the others (scoring.parity_gate: fail)",
    ExitCode.STAGES_DISAGREE: "stages disagree: the run directory's stages do not hold the same samples (status)",
    ExitCode.PREFECT_SERVER: "Prefect's embedded API server did not start in time (a loaded machine): raise "
    f"{EPHEMERAL_STARTUP_SETTING} or point PREFECT_API_URL at a running server, and rerun (it resumes)",
}


def exit_code_table() -> str:
    """The table as `--help` and the README print it."""
    return "\n".join(f"  {int(code)}  {text}" for code, text in EXIT_CODE_MEANINGS.items())


def is_validation_error(exc: BaseException) -> bool:
    from pydantic import ValidationError

    return isinstance(exc, ValidationError)


def exit_code_for(exc: BaseException) -> ExitCode:
    """The documented code for an exception that ended a command; INTERNAL for anything not a user's to fix."""
    from tasks.common.errors import (
        ConfigError,
        DatagenError,
        EndpointUnavailableError,
        FatalEndpointError,
        InsufficientSpaceError,
        SchemaMismatchError,
        SpecialTokenError,
        ValidationGateError,
    )
    from tasks.estimate.errors import EstimateOverBudgetError

    if isinstance(exc, EstimateOverBudgetError):
        return ExitCode.BUDGET
    if _ephemeral_server_timeout(exc):
        return ExitCode.PREFECT_SERVER
    if isinstance(exc, FatalEndpointError | EndpointUnavailableError):
        return ExitCode.ENDPOINT
    if isinstance(exc, ValidationGateError):
        return ExitCode.GATES
    if isinstance(
        exc, ConfigError | SchemaMismatchError | SpecialTokenError | InsufficientSpaceError
    ) or is_validation_error(exc):
        return ExitCode.USER
    if isinstance(exc, PermissionError | FileNotFoundError | IsADirectoryError | NotADirectoryError):
        return ExitCode.USER
    if isinstance(exc, OSError) and exc.errno in (
        errno.ENOSPC,
        errno.EDQUOT,
        errno.EROFS,
        errno.EACCES,
        errno.EIO,
        errno.ESTALE,
    ):
        return ExitCode.USER
    if isinstance(exc, DatagenError):  # ExportError among them (not imported here: its package loads transformers)
        return ExitCode.USER
    if _is_transport_error(exc):
        return ExitCode.ENDPOINT
    return ExitCode.INTERNAL


def _ephemeral_server_timeout(exc: BaseException) -> bool:
    """Whether `exc`, or an exception it was raised from, is Prefect's embedded server not starting in time."""
    seen: set[int] = set()
    link: BaseException | None = exc
    while link is not None and id(link) not in seen:
        seen.add(id(link))
        if isinstance(link, RuntimeError) and str(link).startswith(EPHEMERAL_TIMEOUT_TEXT):
            return True
        link = link.__cause__ or link.__context__
    return False


def ephemeral_timeout_line() -> str:
    """What timed out and the two remedies; Prefect's own message appends the server's whole output."""
    import os

    current = os.environ.get(EPHEMERAL_STARTUP_SETTING)
    within = (
        f"{current} s ({EPHEMERAL_STARTUP_SETTING})"
        if current
        else f"{PREFECT_EPHEMERAL_STARTUP_S} s ({EPHEMERAL_STARTUP_SETTING} unset)"
    )
    try:
        raised = max(2 * int(float(current or PREFECT_EPHEMERAL_STARTUP_S)), EPHEMERAL_STARTUP_DEFAULT_S)
    except ValueError:
        raised = EPHEMERAL_STARTUP_DEFAULT_S
    return (
        f"Prefect's embedded API server did not answer within {within} of being started, a loaded machine: raise "
        f"it (e.g. {EPHEMERAL_STARTUP_SETTING}={raised}) or start a server (prefect server start) and point "
        "PREFECT_API_URL at it, then rerun the same command (it resumes)"
    )


def _is_transport_error(exc: BaseException) -> bool:
    import aiohttp
    import httpx

    return isinstance(exc, aiohttp.ClientConnectionError | httpx.TransportError | ConnectionError)


_KEY_WITH_VALUE = re.compile(r"^([^:=]*?)\s*([:=])\s*\S.*$", re.DOTALL)


def _location(loc: tuple[Any, ...]) -> str:
    """A config location, with whatever follows a `:` or `=` inside a key masked: `api_key:sk-...` (no space
    after the colon) is one unknown key in YAML, and its name is the key."""
    parts = [_KEY_WITH_VALUE.sub(r"\1\2***", str(p)) for p in loc]
    return ".".join(parts) or "(top level)"


def config_error_line(exc: BaseException) -> str:
    """Pydantic echoes offending input values (an api_key typo must not reach the terminal): locations only."""
    from pydantic import ValidationError

    assert isinstance(exc, ValidationError)
    problems = [
        f"{_location(e['loc'])}: {e['msg']}{_did_you_mean(exc.title, e)}" for e in exc.errors(include_input=False)
    ]
    return f"invalid config ({exc.title}): " + "; ".join(problems)


def _did_you_mean(title: str, error: Any) -> str:
    """For an unknown key, the keys beside it that it resembles (`endpoint.max_inflight`: `max_in_flight`), from
    the strict model `title` names; only valid names are printed, never the key as typed."""
    import difflib

    loc = tuple(error["loc"])
    if error["type"] != "extra_forbidden":
        return ""
    model = next((m for m in _strict_models() if m.__name__ == title), None)
    for part in loc[:-1]:
        if model is None:
            return ""
        if isinstance(part, int):
            continue
        field = model.model_fields.get(str(part))
        model = None if field is None else _model_in(field.annotation)
    if model is None or not loc:
        return ""
    typed = str(loc[-1]).split(":")[0].split("=")[0]
    close = difflib.get_close_matches(typed, list(model.model_fields), n=2, cutoff=0.6)
    prefix = ".".join(str(p) for p in loc[:-1])
    names = [f"{prefix}.{name}" if prefix else name for name in close]
    return f" (did you mean {' or '.join(names)}?)" if names else ""


def _strict_models() -> list[type[Any]]:
    from tasks.common.config import StrictModel

    found: list[type[Any]] = []
    todo: list[type[Any]] = [StrictModel]
    while todo:
        cls = todo.pop()
        found.append(cls)
        todo.extend(cls.__subclasses__())
    return found


def _model_in(annotation: Any) -> type[Any] | None:
    """The pydantic model a field holds, directly or inside a list / Optional / union."""
    import typing

    from pydantic import BaseModel

    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        found = _model_in(arg)
        if found is not None:
            return found
    return None


def _os_error_line(exc: OSError) -> str:
    where = f" {exc.filename}" if exc.filename else ""
    hints = {
        errno.EACCES: "check the permissions of that path (or choose another run_dir)",
        errno.EPERM: "check the permissions of that path (or choose another run_dir)",
        errno.EROFS: "the file system is read-only: choose a writable run_dir",
        errno.ENOSPC: "the disk is full: free space or choose a run_dir on a larger disk",
        errno.EDQUOT: "the disk quota is exhausted: free space or choose another run_dir",
        errno.ENOENT: "it does not exist: check the path in the config",
        errno.EISDIR: "that is a directory, a file was expected",
        errno.ENOTDIR: "a part of that path is not a directory",
        errno.EIO: "the disk failed to read or write it: check the device (dmesg), then rerun (stages resume)",
        errno.ESTALE: "the network file system lost that file (a stale handle): remount it, then rerun",
    }
    hint = hints.get(exc.errno or 0, "")
    return f"cannot use{where}: {exc.strerror or exc}" + (f"; {hint}" if hint else "")


def error_line(exc: BaseException, redact: Callable[[str], str] = str) -> str:
    """One line naming what went wrong and what to change; the API key (if `redact` knows it) never shows."""
    code = exit_code_for(exc)
    if is_validation_error(exc):
        text = config_error_line(exc)
    elif isinstance(exc, OSError) and code is ExitCode.USER and exc.errno is not None:
        text = _os_error_line(exc)
    elif code is ExitCode.PREFECT_SERVER:
        text = ephemeral_timeout_line()
    elif code is ExitCode.INTERNAL:
        text = f"internal error: {type(exc).__name__}: {exc} (rerun with --debug for the traceback)"
    elif code is ExitCode.ENDPOINT and not str(exc):
        text = f"endpoint unavailable: {type(exc).__name__}"
    else:
        text = str(exc)
    return "error: " + " ".join(redact(text).split())
