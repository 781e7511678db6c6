"""Where and how a process computes: the torch device, its threads, and the versions of the packages a
run's numbers depend on (recorded in every manifest). One small module, below every stage that uses it."""

from __future__ import annotations

import importlib.metadata
import platform

import torch

import splitleak
from splitleak.errors import ConfigError

PACKAGES = ("torch", "transformers", "tokenizers", "safetensors", "numpy", "pydantic", "faker", "gguf")


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda was requested but no CUDA device is visible; use --device cpu or auto")
    if device not in ("cpu", "cuda") and not device.startswith("cuda:"):
        raise ConfigError(f"unknown device {device!r}; use auto, cpu or cuda")
    return torch.device(device)


def apply_threads(threads: int | None) -> None:
    if threads is not None:
        if threads < 1:
            raise ConfigError(f"--threads must be >= 1, got {threads}")
        torch.set_num_threads(threads)


def fused_optimizer(cls: type[torch.optim.Adam] | type[torch.optim.AdamW], params, **kwargs) -> torch.optim.Optimizer:
    """``cls`` (Adam or AdamW) over ``params`` with ``kwargs``, as torch's fused kernel where the device and
    dtype support it, else the default one. The fused kernel updates each tensor in one pass, where the
    default one on the CPU makes about ten: on GMA-SL's soft labels (12.2 M floats) that is 7 % of a step
    (``benchmarks/fused_adam.py``). The update is the same up to float32 rounding, so results can differ from
    the default kernel's in their last bits."""
    params = list(params)
    # torch checks this only at the first step; the devices are those splitleak runs on (``resolve_device``)
    if all(p.is_floating_point() and p.device.type in ("cpu", "cuda") for p in params):
        return cls(params, fused=True, **kwargs)
    return cls(params, **kwargs)


def package_versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {"python": platform.python_version(), "splitleak": splitleak.__version__}
    for name in PACKAGES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out
