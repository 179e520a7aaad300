"""Backends that run the loop: ``local`` (one process, the embedded default)."""

from rlaxkit.runtime.local import Experiment

__all__ = ["Experiment"]
