"""Store waits that could end only at the store's timeout, made to fail at once (``never_wait_for``).

torch's failed join leaves the group through a wait for its own join token
(``torch.distributed.rpc._utils._group_membership_management``), a key only this process would
ever release. That wait lasted the store's whole timeout, 30 s and more, and the process kept its
join beat going all along (``membership.beating_while_joining``), so the janitor left the token
with it for up to a minute: every other join waited that long too (a new standby and a rejoining
worker, CI's coordinator-restart test and a parallel run's standby test, 2026-12-03). Both of
rpcps's store clients ask ``hopeless`` before they wait: ``rpcps.etcd.store.EtcdStore`` and
``rpcps.transport.store_client.ReconnectingStore``.
"""

from __future__ import annotations

from collections.abc import Sequence

_never_waited: dict[str, str] = {}
"""Keys whose wait fails at once in this process, with the error to raise."""


def never_wait_for(key: str, why: str) -> None:
    """Makes this process's wait for ``key`` (under any prefix: torch's ``PrefixStore``) fail at once
    with ``why``: a key only this process would ever set."""
    _never_waited[key] = why


def hopeless(keys: Sequence[str]) -> str | None:
    """Why a wait for ``keys`` could end only at the timeout, or None when it may end sooner."""
    return next((why for name, why in _never_waited.items() if any(k == name or k.endswith("/" + name) for k in keys)), None)
