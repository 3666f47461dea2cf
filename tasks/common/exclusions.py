"""What a hidden-states part is built from: its tokens part and, with `extract.skip_failed_validation`, the samples
its validation part leaves out (verdict fail or drop), recorded as one digest of their ids.

A hidden-states part used to record its validation part's whole fingerprint. Anything that changed a validation
row without changing which samples are left out (a `validation.billing_tolerance_frac` edit, a warning, a
validation code version) then made every hidden-states part stale, and the next run re-extracted the whole run
on the GPU for the same states. The digest changes only when the left-out samples do.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from typing import Any

from tasks.common.errors import SchemaMismatchError
from tasks.common.shards import PartRef, fingerprint, read_marker, read_part

EXCLUDED_VERDICTS = frozenset({"fail", "drop"})
EXCLUDED_INPUT = "validation_excluded"
"""The hidden-states build's input key for the digest (the tokens part is recorded under "tokens")."""
EXCLUDED_STAT = "excluded_ids_sha256"
"""Where a validation part's marker records the digest when it is written."""
LEGACY_INPUT = "validation"
"""The key under which hidden-states parts written before the digest recorded the validation part's fingerprint."""
UNREADABLE = (OSError, ValueError, SchemaMismatchError)


def excluded_ids_digest(ids: Iterable[str]) -> str:
    return hashlib.sha256("\n".join(sorted(set(ids))).encode()).hexdigest()


def excluded_ids(validation: PartRef) -> set[str]:
    """Sample ids of a finished validation part whose verdict leaves them out of extraction."""
    columns = read_part(validation, columns=["sample_id", "verdict"]).to_pydict()
    return {sid for sid, v in zip(columns["sample_id"], columns["verdict"], strict=True) if v in EXCLUDED_VERDICTS}


def exclusions_digest(validation: PartRef) -> str | None:
    """The digest of the samples a validation part leaves out (None: not finished); from its marker, or from its
    rows for a part written before markers recorded it."""
    if not validation.is_done():
        return None
    try:
        recorded = read_marker(validation).get("stats", {}).get(EXCLUDED_STAT)
        return recorded if isinstance(recorded, str) else excluded_ids_digest(excluded_ids(validation))
    except UNREADABLE:
        return None  # a damaged part is rebuilt (`part_state` reads it as missing), and what it leaves out with it


def hidden_states_inputs(out: PartRef, skip_failed_validation: bool) -> dict[str, str | None]:
    """The inputs a current hidden-states part `out` records.

    A part written before the digest (inputs keyed "validation") stays current while its tokens part is the same
    and it holds exactly the tokens' samples less those validation leaves out now: an upgrade, or a validation
    change that leaves out the same samples, re-extracts nothing."""
    tokens = out.with_stage("tokens")
    inputs: dict[str, str | None] = {"tokens": fingerprint(tokens)}
    if not skip_failed_validation:
        return inputs
    validation = out.with_stage("validation")
    marker = _marker(out)
    if marker is not None and "inputs" not in marker:  # from before lineage: judged by completion order
        return {"tokens": inputs["tokens"], LEGACY_INPUT: fingerprint(validation)}
    inputs[EXCLUDED_INPUT] = exclusions_digest(validation)
    legacy = marker.get("inputs") if marker is not None else None
    if not isinstance(legacy, dict) or set(legacy) != {"tokens", LEGACY_INPUT} or legacy["tokens"] != inputs["tokens"]:
        return inputs
    if legacy[LEGACY_INPUT] == fingerprint(validation):
        return legacy
    if inputs[EXCLUDED_INPUT] is not None and _built_exclusions(out, tokens) == inputs[EXCLUDED_INPUT]:
        return legacy
    return inputs


def _marker(out: PartRef) -> dict[str, Any] | None:
    if not out.is_done():
        return None
    try:
        return read_marker(out)
    except UNREADABLE:
        return None


def _built_exclusions(out: PartRef, tokens: PartRef) -> str | None:
    """The digest of the samples a finished hidden-states part left out of its tokens part's."""
    try:
        kept = set(read_part(out, columns=["sample_id"]).column("sample_id").to_pylist())
        every = set(read_part(tokens, columns=["sample_id"]).column("sample_id").to_pylist())
    except UNREADABLE:
        return None
    return excluded_ids_digest(every - kept)
