"""An Ollama-compatible MLX runner: exact candidate logits for decisions, and generation."""

__version__ = "0.1.0"
