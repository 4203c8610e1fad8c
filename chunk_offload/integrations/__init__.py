"""Integrations of chunk-offload with training frameworks; each optional one in its own module."""
