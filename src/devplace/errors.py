"""The errors a user can cause. Every stage raises these; the CLI prints them as one line and exits 2.

This module imports nothing and sits below every pipeline stage, so `graph/` may use it and still import
nothing else of devplace.
"""

from __future__ import annotations


class DevplaceError(Exception):
    """Base of every error a user can cause: the message says what is wrong and how to fix it."""


class GraphError(DevplaceError):
    """A computation graph is malformed: cycle, duplicate id, unknown node, bad number, bad bytes."""


class FormatError(DevplaceError):
    """A file is not valid JSON, or not of the expected `format` (or an unknown version of it)."""


class ClusterError(DevplaceError):
    """A cluster description is malformed or names an unknown preset."""


class PlacementError(DevplaceError):
    """A placement does not fit its graph or cluster: missing or unknown node, device out of range."""
