"""Typed errors raised where data is produced; each names the sample (or file) and expected vs actual."""

from __future__ import annotations


class DatagenError(Exception):
    """Base class: anything this package raises on purpose."""


class ConfigError(DatagenError):
    pass


class EmptyInputError(ConfigError):
    """A configured dataset holds no valid row (empty, or every row quarantined)."""


class SchemaMismatchError(DatagenError):
    """A shard's schema or schema_version is not the one this code reads."""


class CorruptPartError(SchemaMismatchError):
    """A finished part's file is not what its marker recorded: cut short, overwritten or unreadable."""


class SpecialTokenError(DatagenError):
    """A special token of the completion format does not encode to exactly its own single id."""


class ReconstructionError(DatagenError):
    def __init__(self, sample_id: str, message: str) -> None:
        super().__init__(f"sample {sample_id}: {message}")
        self.sample_id = sample_id


class CaptureMismatchError(DatagenError):
    """Hidden states do not match the token sequence they claim to describe."""

    def __init__(self, sample_id: str, what: str, expected: object, actual: object) -> None:
        super().__init__(f"sample {sample_id}: {what}: expected {expected}, got {actual}")
        self.sample_id = sample_id
        self.expected = expected
        self.actual = actual


class FatalEndpointError(DatagenError):
    """The endpoint refuses the whole run (bad key, no credit): retrying any sample is pointless."""


class ValidationGateError(DatagenError):
    """A configured validation gate was crossed; the report has been written before this is raised."""


class InsufficientSpaceError(DatagenError):
    pass


class ExtractDeploymentError(DatagenError):
    """The extraction deployment the pipeline handed the GPU stage to did not complete."""


class EndpointUnavailableError(ConnectionError):
    """The endpoint does not answer at all (down, starting, overloaded gateway).

    Deliberately not a DatagenError: it is an outage, not a defect, and no sample is marked failed for it. The
    generate stage raises it only after waiting `outage_abort_s`, so Prefect does not retry it
    (`flows.retry_policy`); a rerun resumes.
    """


class DiskFullError(InsufficientSpaceError):
    """The run directory's disk filled during generate: it stopped sending and kept the answers in flight."""


class DiskFailedError(DatagenError):
    """The run directory's disk failed during generate (EIO, a read-only remount): it stopped sending, awaited the
    answers in flight and wrote what the disk could not take to the spill directory."""
