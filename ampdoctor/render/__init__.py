"""Renderers: one output format per module, all reading a Report."""
