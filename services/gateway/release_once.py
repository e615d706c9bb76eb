"""A hold on a shared gateway resource that is given back exactly once.

Admission slots and request-body leases are both released on every path a request can end by
(normal return, client gone, exception), often from more than one of them; the first release
gives the resource back and the rest do nothing. Usable as a sync or async context manager.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from types import TracebackType
from typing import Self


class ReleaseOnce(ABC):
    """Subclasses give their resource back in :meth:`_give_back`; ``release()`` calls it once."""

    __slots__ = ("_released",)

    def __init__(self) -> None:
        self._released = False

    @abstractmethod
    def _give_back(self) -> None:
        """Return the resource to its owner (called once)."""

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._give_back()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()
