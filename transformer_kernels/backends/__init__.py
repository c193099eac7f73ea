"""Backends: plain functions behind the registered ops (``eager``, ``triton``, ``cuda``)."""
