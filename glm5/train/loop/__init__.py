"""The 1-process training loop (docs/training.md)."""
