"""The embedded engine: a compact batched PyTorch engine for Llama-family models."""

from .config import EmbeddedOptions
from .engine import EmbeddedEngine

__all__ = ["EmbeddedEngine", "EmbeddedOptions"]
