"""Prefect Blocks: configuration that lives on the Prefect server (endpoint credentials, ...), registered with
`prefect block register -m blocks`."""

from blocks.endpoint import InferenceEndpointBlock

__all__ = ["InferenceEndpointBlock"]
