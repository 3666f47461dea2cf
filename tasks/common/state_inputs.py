"""What a hidden-states part is built from, and nothing more: per sample of its tokens part, the ids the target
reads and where the answer starts (the states and their scores are functions of those alone), and, with
`extract.skip_failed_validation`, the samples its validation part leaves out (verdict fail or drop). Each is one
digest, recorded in the input part's marker when it is written.

A hidden-states part used to record the tokens and validation parts' whole fingerprints, which change with
everything those parts hold and with their recipes. A change that left every sample's ids and every verdict that
leaves samples out as they were (a loss-mask setting, an edited tokenizer_config.json that encodes the same ids,
`validation.billing_tolerance_frac`, a warning, a validation code version) then made every hidden-states part
stale, and the next run extracted the whole run again on the GPU for the same states.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterable
from typing import Any

import pyarrow as pa

from tasks.common.errors import SchemaMismatchError
from tasks.common.shards import PartRef, fingerprint, read_marker, read_part

IDS_INPUT = "tokens_ids"
"""The hidden-states build's input key for the tokens part's ids digest."""
IDS_STAT = "state_inputs_sha256"
"""Where a tokens part's marker records that digest when it is written."""
IDS_COLUMNS = ["sample_id", "dataset", "prompt_len", "input_ids"]
"""What extraction and its scores read of a tokens row."""
EXCLUDED_VERDICTS = frozenset({"fail", "drop"})
EXCLUDED_INPUT = "validation_excluded"
"""The hidden-states build's input key for the digest of the samples validation leaves out."""
EXCLUDED_STAT = "excluded_ids_sha256"
"""Where a validation part's marker records that digest when it is written."""
LEGACY_TOKENS, LEGACY_VALIDATION = "tokens", "validation"
"""The keys under which hidden-states parts written before the digests recorded whole fingerprints."""
UNREADABLE = (OSError, ValueError, SchemaMismatchError)


def ids_digest(tokens: pa.Table) -> str:
    """Digest of each row's sample id, dataset, answer start and ids, in order."""
    digest = hashlib.sha256()
    table = tokens.select(IDS_COLUMNS).combine_chunks()
    if not table.num_rows:
        return digest.hexdigest()
    ids = table.column("input_ids").chunk(0)
    offsets = ids.offsets.to_numpy()
    values = ids.values.to_numpy(zero_copy_only=False).astype("<i8")
    rows = zip(*(table.column(c).to_pylist() for c in IDS_COLUMNS[:3]), offsets[:-1], offsets[1:], strict=True)
    for sample_id, dataset, prompt_len, start, end in rows:
        digest.update(json.dumps([sample_id, dataset, prompt_len, int(end - start)]).encode())
        digest.update(values[start:end].tobytes())
    return digest.hexdigest()


def excluded_ids_digest(ids: Iterable[str]) -> str:
    return hashlib.sha256("\n".join(sorted(set(ids))).encode()).hexdigest()


def left_out(sample_ids: Iterable[str], verdicts: Iterable[str]) -> set[str]:
    """The sample ids whose verdict leaves them out of extraction."""
    return {sid for sid, v in zip(sample_ids, verdicts, strict=True) if v in EXCLUDED_VERDICTS}


def excluded_ids(validation: PartRef) -> set[str]:
    """Sample ids of a finished validation part whose verdict leaves them out of extraction."""
    columns = read_part(validation, columns=["sample_id", "verdict"]).to_pydict()
    return left_out(columns["sample_id"], columns["verdict"])


def tokens_ids_digest(tokens: PartRef) -> str | None:
    """`ids_digest` of a finished tokens part, from its marker (None: not finished, or damaged: `part_state` reads
    it as missing and it is rebuilt). A part written before markers recorded it stands for itself by its
    fingerprint: hashing its ids again would read every id of the run each time a part's state is asked, and such a
    part changes only by being rebuilt, which records the digest."""
    return _recorded_or(tokens, IDS_STAT, lambda: f"fingerprint:{fingerprint(tokens)}")


def exclusions_digest(validation: PartRef) -> str | None:
    """The digest of the samples a finished validation part leaves out, like `tokens_ids_digest`."""
    return _recorded_or(validation, EXCLUDED_STAT, lambda: excluded_ids_digest(excluded_ids(validation)))


def hidden_states_inputs(out: PartRef, skip_failed_validation: bool) -> dict[str, str | None]:
    """The inputs a current hidden-states part `out` records.

    A part written before the digests (inputs keyed by stage) stays current while its tokens part is the one it
    was extracted from and it holds exactly the tokens' samples less those validation leaves out now: an upgrade
    re-extracts nothing. A marker from before lineage keeps being judged by completion order."""
    tokens, validation = out.with_stage("tokens"), out.with_stage("validation")
    marker = _marker(out)
    recorded = marker.get("inputs") if marker is not None else None
    legacy = _legacy_shape(tokens, validation, skip_failed_validation)
    if marker is not None and recorded is None:
        return legacy
    if (
        isinstance(recorded, dict)
        and set(recorded) == set(legacy)
        and recorded[LEGACY_TOKENS] == legacy[LEGACY_TOKENS]
        and (
            not skip_failed_validation
            or recorded[LEGACY_VALIDATION] == legacy[LEGACY_VALIDATION]
            or _same_exclusions(out, tokens, validation)
        )
    ):
        return dict(recorded)
    inputs = {IDS_INPUT: tokens_ids_digest(tokens)}
    if skip_failed_validation:
        inputs[EXCLUDED_INPUT] = exclusions_digest(validation)
    return inputs


def _legacy_shape(tokens: PartRef, validation: PartRef, skip_failed_validation: bool) -> dict[str, str | None]:
    shape = {LEGACY_TOKENS: fingerprint(tokens)}
    if skip_failed_validation:
        shape[LEGACY_VALIDATION] = fingerprint(validation)
    return shape


def _recorded_or(ref: PartRef, stat: str, compute: Callable[[], str]) -> str | None:
    """The digest a finished part's marker recorded under `stat`, else `compute()`; None when the part is not
    finished or cannot be read."""
    marker = _marker(ref)
    if marker is None:
        return None
    recorded = marker.get("stats", {}).get(stat)
    if isinstance(recorded, str):
        return recorded
    try:
        return compute()
    except UNREADABLE:
        return None


def _marker(ref: PartRef) -> dict[str, Any] | None:
    if not ref.is_done():
        return None
    try:
        return read_marker(ref)
    except UNREADABLE:
        return None


def _same_exclusions(out: PartRef, tokens: PartRef, validation: PartRef) -> bool:
    now = exclusions_digest(validation)
    return now is not None and _built_exclusions(out, tokens) == now


def _built_exclusions(out: PartRef, tokens: PartRef) -> str | None:
    """The digest of the samples a finished hidden-states part left out of its tokens part's."""
    try:
        kept = set(read_part(out, columns=["sample_id"]).column("sample_id").to_pylist())
        every = set(read_part(tokens, columns=["sample_id"]).column("sample_id").to_pylist())
    except UNREADABLE:
        return None
    return excluded_ids_digest(every - kept)
