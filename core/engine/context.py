"""The run context handed to lifecycle hooks (:class:`alignzoo.types.RunContext`, at the
package root with the rest of the plugin contract; this path keeps working)."""

from __future__ import annotations

from alignzoo.types import RunContext

__all__ = ["RunContext"]
