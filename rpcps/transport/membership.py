"""Private torch RPC internals, in one place: removing departed members from a dynamic group.

In a dynamic group a joining process calls every member listed in the store. A member that died
stays listed, so every later join would fail (and leak the group's join token). The group janitor
(``rpcps.transport.coordinator``) therefore removes dead or departed members: from its own agent's
view and from the store's member list, holding the same token that joins hold; a replica that
promotes itself removes the primary it replaces the same way, from any member (every agent has a
client of the store). Both steps use private torch APIs (pinned by
tests/integration/test_membership.py); nothing else in rpcps touches them.
"""

from __future__ import annotations

import itertools
import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager

from torch.distributed.rpc import api

logger = logging.getLogger(__name__)

_MEMBERS_KEY = "names/_ALL_WORKER_INFOS"
_TOKEN_KEY = "RpcGroupManagementToken"
_token_names = itertools.count()


class TokenBusy(RuntimeError):
    """A join or leave holds the group token right now; try again shortly."""


@contextmanager
def _holding_token() -> Iterator[None]:
    """Takes the group token without waiting, so joins cannot run while the member list changes.

    torch's own helper waits for the token with the store's full timeout (the RPC timeout); a
    reaper blocked there for 30 s behind a dying join used to give up on the member it was
    removing, leaving it listed for good. Here a busy token raises TokenBusy and the caller retries.
    The token is released with the ``"Done"`` marker torch's waiters poll for.
    """
    store = api._get_current_rpc_agent().store
    mine = f"Token_for_rpcps-{os.getpid()}-{next(_token_names)}_join"
    holder = store.compare_set(_TOKEN_KEY, "", mine).decode()
    if holder != mine:
        raise TokenBusy(f"group token held by {holder}")
    try:
        yield
    finally:
        store.set(_TOKEN_KEY, "")
        store.set(mine, "Done")


def store_members() -> dict[str, int]:
    """The group's member list as the store has it: name -> rank (torch writes "name-rank," entries)."""
    raw = api._get_current_rpc_agent().store.get(_MEMBERS_KEY).decode()
    members: dict[str, int] = {}
    for entry in raw.split(","):
        name, sep, rank = entry.rpartition("-")
        if sep and name:
            members[name] = int(rank)
    return members


def forget_member(name: str) -> bool:
    """Makes this process's agent and the group's store forget RPC member ``name``.

    Returns False when the member was not known to either. Runs in any member (the store's
    list is shared; the agent is this process's). Raises TokenBusy while a join is in progress.
    """
    with _holding_token():
        return _forget_locked(name)


def forget_failed_joins() -> list[str]:
    """Removes listed members this agent never heard of: processes whose join failed half-way.

    A join adds its name to the store and then tells every member, this server included, all while
    holding the token; with the token held here no join is in progress, so a listed name this
    agent does not know can only be a join that failed (its process is gone or about to exit).
    Raises TokenBusy while a join is in progress.
    """
    with _holding_token():
        known = set(member_names())
        failed = [name for name in store_members() if name not in known]
        for name in failed:
            _forget_locked(name)
        return failed


def _forget_locked(name: str) -> bool:
    agent = api._get_current_rpc_agent()
    forgotten = False
    info = next((w for w in agent.get_worker_infos() if w.name == name), None)
    if info is not None:
        agent._update_group_membership(info, [], {}, False)
        forgotten = True
    store = agent.store
    entries = [e for e in store.get(_MEMBERS_KEY).decode().split(",") if e]
    kept = [e for e in entries if e.rpartition("-")[0] != name]
    if len(kept) != len(entries):
        store.set(_MEMBERS_KEY, "".join(f"{e}," for e in kept))
        forgotten = True
    if forgotten:
        logger.info("removed %s from the RPC group", name)
    return forgotten


def forget_me(name: str) -> str:
    """Runs on the store's host at a departing member's request (see ``group.leave``).

    Returns 'done', 'unknown' or 'busy' rather than raising, so the caller can retry a busy token
    without parsing a remote traceback.
    """
    try:
        return "done" if forget_member(name) else "unknown"
    except TokenBusy:
        return "busy"


class JoinTokenWatch:
    """Frees the group's join token when a process died holding it.

    A process killed in the middle of its join (or whose join failed) never releases the token, and
    every later join then waits on it forever. A join normally holds it for milliseconds; one held
    past ``max_age_s`` is released here.
    """

    def __init__(self, max_age_s: float) -> None:
        self.max_age_s = max_age_s
        self._seen: tuple[str, float] | None = None

    def check(self, now: float) -> str | None:
        """Returns the token it released, if any."""
        store = api._get_current_rpc_agent().store
        holder = store.compare_set(_TOKEN_KEY, "", "").decode()  # reads without changing it
        if not holder:
            self._seen = None
            return None
        if self._seen is None or self._seen[0] != holder:
            self._seen = (holder, now)
            return None
        if now - self._seen[1] < self.max_age_s:
            return None
        if store.compare_set(_TOKEN_KEY, holder, "").decode() == "":
            store.set(holder, "Done")  # wakes anyone waiting on the dead holder
            logger.warning("released the RPC group token held by a dead join (%s)", holder)
            self._seen = None
            return holder
        return None


def my_name() -> str:
    return api._get_current_rpc_agent().get_worker_info().name


def member_names() -> list[str]:
    return [w.name for w in api._get_current_rpc_agent().get_worker_infos()]
