"""Target-model hidden states for EAGLE-3 drafters: layer choice, capture backends, shard storage, stage."""

from tasks.extract.layers import LayerSelectionError, default_aux_layers, resolve_layers, validate_layers
from tasks.extract.storage import estimate_bytes, load_hidden_states

__all__ = [
    "LayerSelectionError",
    "default_aux_layers",
    "estimate_bytes",
    "load_hidden_states",
    "resolve_layers",
    "validate_layers",
]
