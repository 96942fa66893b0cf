"""Private torch internals: refusing the builtin operators a peer can run without pickle.

``rpc_sync(dst, torch.from_file, ...)`` does not travel as a pickled Python call: torch sends it as
a SCRIPT_CALL that C++ decodes and runs against the operator registry, so the restricted unpickler
(``pickling``) never sees it. torch has no Python hook for those messages (the request callback is
fixed when the agent is built). What Python *can* do is replace an operator's kernels at the
dispatcher, process-wide. ``aten::from_file`` is the one measured primitive that reads, creates
and grows arbitrary files (shared-research findings), and nothing in rpcps uses it, so its
kernels are replaced by one that refuses.

This is a deny-list: other builtin operators still run for any peer that reaches the agent (the
cheap ones are harmless; ``torch.empty`` of a huge size exhausts memory). docs/SECURITY.md says why
the C++ request callback that would refuse them all is not shipped.
"""

from __future__ import annotations

import logging
import threading
import warnings
from typing import Any

import torch

logger = logging.getLogger(__name__)

DENIED_OPS = ("from_file", "from_file.out")
"""Overloads of ``aten::from_file`` (file read, create and grow from a peer's arguments)."""
_DISPATCH_KEYS = ("BackendSelect", "CPU")
"""Factory functions are routed at BackendSelect; CPU covers a direct backend call."""

_library: torch.library.Library | None = None
_lock = threading.Lock()


class OperatorRefused(RuntimeError):
    """A denied builtin operator was called in this process."""


def _refuse(*_args: Any, **_kwargs: Any) -> Any:
    logger.warning("refused a call of aten::from_file (an RPC peer, or code in this process); see docs/SECURITY.md")
    raise OperatorRefused("aten::from_file is refused in this process (rpcps denies it to RPC peers)")


def deny() -> None:
    """Replaces the kernels of ``DENIED_OPS`` for the life of the process (idempotent)."""
    global _library
    with _lock:
        if _library is not None:
            return
        library = torch.library.Library("aten", "IMPL")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "overriding a previously registered kernel": that is the point
            for op in DENIED_OPS:
                for key in _DISPATCH_KEYS:
                    library.impl(op, _refuse, key)
        _library = library  # the registration lives as long as this object


def denied() -> bool:
    return _library is not None
