"""Loading and cutting models: presets, any Hugging Face causal LM, and `SplitModel`."""

from splitleak.models.presets import (
    PRESETS,
    LoadedModel,
    load_model,
    model_fingerprint,
    preset_available,
    smollm2_gguf_path,
    tiny_tokenizer,
)
from splitleak.models.split import BlockContext, SplitModel, SplitSpec, make_spec, next_token_loss

__all__ = [
    "PRESETS",
    "BlockContext",
    "LoadedModel",
    "SplitModel",
    "SplitSpec",
    "load_model",
    "make_spec",
    "model_fingerprint",
    "next_token_loss",
    "preset_available",
    "smollm2_gguf_path",
    "tiny_tokenizer",
]
