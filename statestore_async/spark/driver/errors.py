"""What the operator raises about its settings, its fence and its tasks' reports.
"""
from __future__ import annotations

from statestore_async.errors import (
    InterfaceError,
    VersionError,
)


class OperatorConfigError(InterfaceError):
    """The operator's settings disagree with what its checkpoint recorded (partitions, key groups, keys)."""


class FenceTimeoutError(VersionError):
    """Reported checkpoint files did not appear in the object store in time: the batch is not committed."""


class DuplicateReportError(VersionError):
    """Two committed attempts reported for one partition of one batch (should never happen)."""


class OutputReadError(InterfaceError):
    """With ``materialize="none"`` the sink did not read the batch's whole output exactly once."""
