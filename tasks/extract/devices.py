"""Where an accelerate-dispatched module computes: shared by the extraction runner and the score head, which both
place tensors next to a module that may be offloaded."""

from __future__ import annotations

import torch
from torch import nn


def module_device(module: nn.Module, fallback: torch.device) -> torch.device:
    """Where `module` computes. A module accelerate dispatched with offloading (`device_map` entries "cpu" or
    "disk" next to GPUs, or a model larger than the GPUs) keeps its parameters on `meta` between forwards; its
    hook's `execution_device` is where its inputs and outputs live."""
    hook = getattr(module, "_hf_hook", None)
    for each in [hook, *getattr(hook, "hooks", ())]:
        device = getattr(each, "execution_device", None)
        if device is not None:
            return torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    for param in module.parameters():
        if param.device.type != "meta":
            return param.device
    return fallback
