"""The one error class every piece of bad user input raises.

`PartitionerError` is a `ValueError`, so callers that already catch
`ValueError` keep working; each subclass names the kind of input that was
wrong. Messages say what is wrong, why, and how to fix it (STYLE.md item 8).
"""

from __future__ import annotations

__all__ = ["PartitionerError", "TopologyError", "TraceError", "DeclarationError"]


class PartitionerError(ValueError):
    """Bad input to the project: the message names the field and the fix."""


class TopologyError(PartitionerError):
    """A topology string, dict, file or keyword that does not describe hardware."""


class TraceError(PartitionerError):
    """A model that cannot be captured as a graph, with what to try instead."""


class DeclarationError(PartitionerError):
    """A user declaration (dp, tp, batch size, ...) that cannot hold."""
