"""The one base of regen's expected failures.

A stage that fails for a reason a person can act on raises a subclass of :class:`RegenError`;
anything else is a bug and keeps its traceback. The class and its ``detail`` survive the trip from
an SSH node (as a result document), so the same exception is raised wherever the stage ran.
"""

from __future__ import annotations

from typing import Any, ClassVar


class RegenError(RuntimeError):
    """An expected failure: the message says what went wrong and what to do."""

    registry: ClassVar[dict[str, type["RegenError"]]] = {}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        RegenError.registry[cls.__name__] = cls

    def detail(self) -> dict[str, Any]:
        """Structured data beside the message (e.g. preflight's problem list)."""
        return {}

    def to_doc(self) -> dict[str, Any]:
        return {"type": type(self).__name__, "message": str(self), "detail": self.detail()}

    @classmethod
    def from_detail(cls, message: str, detail: dict[str, Any]) -> "RegenError":
        return cls(message)

    @staticmethod
    def from_doc(doc: dict[str, Any], where: str = "") -> "RegenError":
        """The exception a result document describes; an unknown type becomes a RemoteError."""
        cls = RegenError.registry.get(doc.get("type", ""), RemoteError)
        message = doc.get("message", "")
        if cls is RemoteError and doc.get("type") not in ("RemoteError", None):
            message = f"{doc.get('type')}: {message}"
        if where and cls is RemoteError:
            message = f"{where}: {message}"
        return cls.from_detail(message, doc.get("detail") or {})


class RemoteError(RegenError):
    """A stage on an SSH node failed without a result; the message carries its output's end."""


class DataError(RegenError, ValueError):
    """Input data (a dataset, a prompt file) that cannot be read as asked; a usage error."""


class ShardFailed(RegenError):
    """The shard cannot finish now; what it finished is kept and a rerun resumes from it."""
