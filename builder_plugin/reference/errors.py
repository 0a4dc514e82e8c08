"""The reference's one error type."""

from __future__ import annotations


class ReferenceModelError(ValueError):
    """Raised when a checkpoint or an input does not fit the reference model."""
