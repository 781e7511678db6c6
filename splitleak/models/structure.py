"""Where a transformers causal LM keeps its decoder blocks and its final norm: what a cut needs to find, for GPT-2,
Llama, Qwen, Gemma, Mistral and GPT-NeoX layouts."""

from __future__ import annotations

from typing import Any

import torch

from splitleak.errors import ModelError

_BLOCK_PATHS = (("transformer", "h"), ("model", "layers"), ("gpt_neox", "layers"), ("model", "decoder", "layers"))
_NORM_NAMES = ("ln_f", "norm", "final_layernorm", "final_layer_norm")


def find_blocks(model: torch.nn.Module) -> tuple[Any, torch.nn.ModuleList, str]:
    """(the module that owns the block list, the list, the attribute name) or a ModelError. The owner
    is the transformers base model (``get_input_embeddings``, ``config``), reached by attribute path."""
    for path in _BLOCK_PATHS:
        owner: Any = model
        ok = True
        for part in path[:-1]:
            owner = getattr(owner, part, None)
            if owner is None:
                ok = False
                break
        if ok and isinstance(getattr(owner, path[-1], None), torch.nn.ModuleList):
            return owner, getattr(owner, path[-1]), path[-1]
    raise ModelError(
        f"cannot cut {type(model).__name__}: splitleak needs the decoder blocks as a ModuleList at "
        f"transformer.h (GPT-2) or model.layers (Llama, Qwen, Gemma, Mistral); this model has neither"
    )


def find_final_norm(owner: torch.nn.Module) -> torch.nn.Module:
    for name in _NORM_NAMES:
        mod = getattr(owner, name, None)
        if isinstance(mod, torch.nn.Module):
            return mod
    raise ModelError(f"cannot find the final norm of {type(owner).__name__} (looked for {', '.join(_NORM_NAMES)})")
