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


def package_versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {"python": platform.python_version(), "splitleak": splitleak.__version__}
    for name in PACKAGES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out
