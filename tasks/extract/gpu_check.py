"""Refuse to start a GPU stage whose torch build has no kernels for the GPU it sees.

A torch wheel carries machine code (SASS, `sm_XY` in `torch.cuda.get_arch_list()`) for some compute
capabilities and, in some builds, PTX (`compute_XY`) that the driver can compile for newer ones. Without either
for the device, the first kernel fails hours into a run ("no kernel image is available for execution on the
device"), and torch itself only warns at `import`. This module decides, per visible device, which entry of the
arch list will run on it, with CUDA's compatibility rules:

- `sm_XY` runs on compute capability X.Z for Z >= Y (same major only): sm_80 runs on an A10 (8.6), sm_120 on
  8.x never, sm_100 on a B300 (10.3), sm_90 on Blackwell never;
- `sm_XYa` (architecture-specific features) runs on exactly X.Y; `sm_XYf` (family) on X.Z for Z >= Y;
- `compute_XY` (PTX) is compiled by the driver for any device of capability >= X.Y; the first launches then
  pay a JIT compile (minutes for torch, cached in ~/.nv/ComputeCache), so native SASS is preferred and the
  verdict says which one it used. `compute_XYa` / `compute_XYf` PTX follows the `a` / `f` rule above.

`python -m tasks.extract.gpu_check` is the GPU worker's start check (docker/Dockerfile.gpu runs it before
`prefect worker start`); with `--require sm_90,sm_100,sm_120` it checks the build itself and needs no GPU
(the image build runs it, so a base image without Blackwell kernels fails to build). `tasks.extract.stage.
make_runner` runs the device check again before loading a model onto CUDA.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tasks.common.errors import ConfigError

_ARCH = re.compile(r"^(sm|compute)_(\d+)(\d)([af]?)$")


class GPUArchMismatchError(ConfigError):
    """The torch build cannot run kernels on a visible GPU (or lacks a required architecture)."""


@dataclass(frozen=True)
class ArchEntry:
    """One entry of `torch.cuda.get_arch_list()`: `sm_90a` is ArchEntry(False, 9, 0, "a")."""

    ptx: bool
    major: int
    minor: int
    variant: str

    @classmethod
    def parse(cls, text: str) -> ArchEntry | None:
        match = _ARCH.match(text.strip())
        if match is None:
            return None
        kind, major, minor, variant = match.groups()
        return cls(kind == "compute", int(major), int(minor), variant)

    def runs_on(self, major: int, minor: int) -> bool:
        if self.variant == "a":
            return (major, minor) == (self.major, self.minor)
        if self.variant == "f" or not self.ptx:
            return major == self.major and minor >= self.minor
        return (major, minor) >= (self.major, self.minor)

    def __str__(self) -> str:
        return f"{'compute' if self.ptx else 'sm'}_{self.major}{self.minor}{self.variant}"


@dataclass(frozen=True)
class DeviceVerdict:
    index: int
    name: str
    capability: tuple[int, int]
    native: str | None
    """The `sm_*` entry whose SASS runs on the device, if any."""
    ptx: str | None
    """The `compute_*` entry the driver can JIT for the device, if any (used only without native SASS)."""

    @property
    def ok(self) -> bool:
        return self.native is not None or self.ptx is not None

    @property
    def sm(self) -> str:
        return f"sm_{self.capability[0]}{self.capability[1]}"

    def describe(self) -> str:
        how = (
            f"native {self.native}"
            if self.native
            else f"PTX JIT from {self.ptx} (first launches compile kernels)"
            if self.ptx
            else "NO KERNELS"
        )
        return f"cuda:{self.index} {self.name} ({self.sm}): {how}"


def kernel_for(arch_list: Sequence[str], capability: tuple[int, int]) -> tuple[str | None, str | None]:
    """(native sm_* entry, PTX compute_* entry) of `arch_list` that run on a device of `capability`; the
    newest of each kind, None where none does. Entries that are not CUDA arches (ROCm gfx*) never match."""
    major, minor = capability
    entries = [e for e in (ArchEntry.parse(a) for a in arch_list) if e is not None and e.runs_on(major, minor)]
    native = max((e for e in entries if not e.ptx), key=lambda e: (e.major, e.minor), default=None)
    ptx = max((e for e in entries if e.ptx), key=lambda e: (e.major, e.minor), default=None)
    return (str(native) if native else None, str(ptx) if ptx else None)


def build_arch_list() -> list[str]:
    """The arches this torch build carries kernels for. `torch.cuda.get_arch_list()` answers [] when no GPU
    is visible (an image build), so the compiled flags are read directly then."""
    arches = torch.cuda.get_arch_list()
    if arches:
        return arches
    flags = getattr(torch._C, "_cuda_getArchFlags", None)
    value = flags() if callable(flags) else None
    return value.split() if isinstance(value, str) else []


def _torch_build() -> str:
    cuda = torch.version.cuda
    return f"torch {torch.__version__} (CUDA {cuda})" if cuda else f"torch {torch.__version__} (no CUDA)"


def check_devices() -> list[DeviceVerdict]:
    """A verdict per visible CUDA device; raises `GPUArchMismatchError` (one message naming every device
    without kernels, the build's arch list and what to use instead) if any has none, or if none is visible.

    Reads torch at the boundary: `get_arch_list`, `is_available`, `device_count`, `get_device_capability`,
    `get_device_name`.
    """
    if not torch.cuda.is_available():
        raise GPUArchMismatchError(f"no CUDA device is visible to {_torch_build()}; the GPU worker needs one")
    arches = torch.cuda.get_arch_list()
    verdicts = []
    for index in range(torch.cuda.device_count()):
        major, minor = torch.cuda.get_device_capability(index)
        native, ptx = kernel_for(arches, (major, minor))
        verdicts.append(DeviceVerdict(index, torch.cuda.get_device_name(index), (major, minor), native, ptx))
    bad = [v for v in verdicts if not v.ok]
    if bad:
        devices = ", ".join(f"cuda:{v.index} {v.name} ({v.sm})" for v in bad)
        needed = " or ".join(sorted({v.sm for v in bad}))
        raise GPUArchMismatchError(
            f"{_torch_build()} has no kernels for {devices}: its arch list is [{' '.join(arches) or 'empty'}]; "
            f"run an image whose torch lists {needed} (docker/Dockerfile.gpu: CUDA 13.0 build with sm_90 sm_100 "
            "sm_120)"
        )
    return verdicts


def check_build(required: Sequence[str], arch_list: Sequence[str] | None = None) -> list[str]:
    """Raises unless every required capability (`sm_90`, `sm_120`, ...) gets native SASS from the build;
    returns the build's arch list. Needs no GPU."""
    arches = list(build_arch_list() if arch_list is None else arch_list)
    missing = []
    for arch in required:
        entry = ArchEntry.parse(arch)
        if entry is None or entry.ptx:
            raise GPUArchMismatchError(f"required arch {arch!r} is not of the form sm_XY")
        if kernel_for(arches, (entry.major, entry.minor))[0] is None:
            missing.append(arch)
    if missing:
        raise GPUArchMismatchError(
            f"{_torch_build()} lacks native kernels for {' '.join(missing)}: its arch list is "
            f"[{' '.join(arches) or 'empty'}]"
        )
    return arches


def check_before_load(device: str, device_map: str | None, backend: str) -> list[DeviceVerdict]:
    """`make_runner`'s check: every visible device, when CUDA is available and the extract config puts the
    model on it (the sglang backend, a `device_map`, `device` auto / cuda / cuda:N). Without CUDA there is
    nothing to check: a config asking for it is refused by the backend itself."""
    if not torch.cuda.is_available():
        return []
    if backend != "sglang" and device_map is None and not (device == "auto" or device.startswith("cuda")):
        return []
    return check_devices()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Check that torch has kernels for every visible GPU; with a command after `--`, run it "
        "in this process's place once the check passes (the GPU worker's CMD)."
    )
    parser.add_argument(
        "--require",
        default="",
        help="comma-separated sm_XY the build must carry natively; checks the build only, needs no GPU",
    )
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- prefect worker start ...")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    try:
        if args.require:
            arches = check_build([a for a in args.require.split(",") if a])
            print(f"{_torch_build()}: arch list [{' '.join(arches)}] covers {args.require}", flush=True)
        else:
            for verdict in check_devices():
                print(verdict.describe(), flush=True)
    except GPUArchMismatchError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 1
    if command:
        os.execvp(command[0], command)
    return 0


if __name__ == "__main__":
    sys.exit(main())
