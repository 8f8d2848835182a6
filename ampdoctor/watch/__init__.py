"""Watching tensors: hooks on a model, on-device statistics, the per-step CSV log."""
