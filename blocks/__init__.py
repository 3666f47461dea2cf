"""Prefect Blocks: configuration that lives on the Prefect server, registered with `prefect block register -m blocks`.

Each converts to the matching section of the strict `PipelineConfig`; flows take block names, never secrets.
"""

from blocks.artifact_store import ArtifactStoreBlock
from blocks.backend import HiddenStateBackendBlock
from blocks.endpoint import InferenceEndpointBlock
from blocks.tokenizer import TokenizerSourceBlock

__all__ = ["ArtifactStoreBlock", "HiddenStateBackendBlock", "InferenceEndpointBlock", "TokenizerSourceBlock"]
