"""What may cross the wire as a value besides tensors and plain data: records and enums built so that
a payload cannot change an existing object (``rpcps.transport.pickling`` explains the rule).

- ``WireRecord``: the base of a frozen dataclass sent over RPC. It pickles as a call of its
  constructor with its fields (no NEWOBJ, no BUILD), and refuses ``__setstate__``: a payload can
  only build a new record, through its ``__init__`` and its checks.
- ``WireEnum``: the base of a string enum sent over RPC. Members are shared by the whole process,
  so ``__setstate__`` refuses (BUILD on a member would rewrite its value for everyone).

``rpcps.transport.protection.Surface`` accepts no other value class, and the transport's unpickler
counts a ``StateRefused`` as a refused mutation. A leaf module: ``rpcps.messages`` and the transport
both import it.
"""

from __future__ import annotations

import dataclasses
import enum
import pickle
from typing import Any, NoReturn


class StateRefused(pickle.UnpicklingError):
    """A payload tried to set the state of a record or an enum member (pickle's BUILD)."""


def refuse_state(obj: Any, *_args: Any) -> NoReturn:
    """The ``__setstate__`` of every wire value: records reduce to constructor calls and enum members
    are shared, so no legitimate payload sets a state; BUILD on one is refused."""
    cls = obj if isinstance(obj, type) else type(obj)
    raise StateRefused(f"{cls.__module__}.{cls.__qualname__}")


_FIELDS: dict[type, tuple[str, ...]] = {}
"""Constructor field names per record class, found once (``dataclasses.fields`` on every send costs
more than the rest of the reduce)."""


class WireRecord:
    """Base of the frozen dataclasses rpcps sends: pickled as ``cls(*fields)``."""

    __slots__ = ()

    def __reduce__(self) -> tuple[type, tuple[Any, ...]]:
        cls = type(self)
        names = _FIELDS.get(cls)
        if names is None:
            names = _FIELDS[cls] = tuple(f.name for f in dataclasses.fields(self) if f.init)  # type: ignore[arg-type]
        return cls, tuple(getattr(self, name) for name in names)

    __setstate__ = refuse_state


class WireEnum(enum.StrEnum):
    """Base of the string enums rpcps sends: members pickle by value and cannot be changed by a payload."""

    __setstate__ = refuse_state


def is_wire_value(cls: type) -> bool:
    """A class a payload may build: a ``WireRecord`` dataclass or a ``WireEnum``."""
    shaped = dataclasses.is_dataclass(cls) and issubclass(cls, WireRecord) or issubclass(cls, WireEnum)
    return bool(shaped) and getattr(cls, "__setstate__", None) is refuse_state
