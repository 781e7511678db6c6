"""splitleak: measure what crosses the split in split learning of language models."""

__version__ = "0.1.0"
