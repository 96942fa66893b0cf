"""Private torch RPC internals, in one place: removing departed members from a dynamic group.

In a dynamic group a joining process calls every member listed in the store. A member that died
stays listed, so every later join would fail (and leak the group's join token). The server
therefore removes dead or departed members itself: from its own agent's view and from the store's
member list, holding the same token that joins hold. Both steps use private torch APIs (pinned by
tests/integration/test_membership.py); nothing else in rpcps touches them.
"""

from __future__ import annotations

import logging

from torch.distributed.rpc import api
from torch.distributed.rpc._utils import _group_membership_management

logger = logging.getLogger(__name__)

_MEMBERS_KEY = "names/_ALL_WORKER_INFOS"


def forget_member(name: str) -> bool:
    """Makes this process's agent and the group's store forget RPC member ``name``.

    Returns False when the member was not known. Must run on the store's host (the server).
    """
    agent = api._get_current_rpc_agent()
    info = next((w for w in agent.get_worker_infos() if w.name == name), None)
    if info is None:
        return False
    agent._update_group_membership(info, [], {}, False)
    store = agent.store
    me = agent.get_worker_info().name
    with _group_membership_management(store, f"{me}-forget-{name}", True):
        members = store.get(_MEMBERS_KEY).decode()
        store.set(_MEMBERS_KEY, members.replace(f"{name}-{info.id},", ""))
    logger.info("removed %s (rank %d) from the RPC group", name, info.id)
    return True


_TOKEN_KEY = "RpcGroupManagementToken"


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


def member_names() -> list[str]:
    return [w.name for w in api._get_current_rpc_agent().get_worker_infos()]
