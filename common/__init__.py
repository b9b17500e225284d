"""kvwake: an agent memory daemon for MLX."""

__version__ = "0.1.0"
