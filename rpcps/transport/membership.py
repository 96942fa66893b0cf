"""Private torch RPC internals, in one place: the group's member list and the store keys behind it.

In a dynamic group a joining process calls every member listed in the store. A member that died
stays listed, so every later join would fail (and leak the group's join token). The group janitor
(``rpcps.transport.coordinator``, in whichever process hosts the store) therefore removes dead or
departed members: from its own agent's view and from the store's member list, holding the same
token that joins hold; a replica that promotes itself removes the primary it replaces the same way,
from any member (every agent has a client of the store). The store has no authentication, so its
host also puts back what a stranger changed there (``StoreKeeper``), and the join handshake's
membership call is handed out guarded (``guarded_update_group_membership``). All of it uses private
torch APIs and store keys (pinned by tests/integration/rpcps/test_membership.py and test_hostile_peers.py);
nothing else in rpcps touches them.
"""

from __future__ import annotations

import itertools
import logging
import os
import re
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
import torch.distributed.rpc as torch_rpc
from torch.distributed.rpc import WorkerInfo, _utils, api

from rpcps.jobsecret import JobSecret, matches
from rpcps.logsafe import peer_text
from rpcps.periodic import Periodic

logger = logging.getLogger(__name__)

# Keys of torch's RPC prefix store (the agent's ``store``): agent_utils.cpp and tensorpipe_agent.cpp.
_MEMBERS_KEY = "names/_ALL_WORKER_INFOS"
"""The member list, "name-rank," entries; every join reads it and appends itself."""
_ADDRESS_PREFIX = "addrs/"
"""``addrs/<name>``: where member ``name``'s agent listens; joiners connect there."""
_REJOINED_PREFIX = "rpcps_rejoined/"
"""``rpcps_rejoined/<name>``: member ``name`` put itself back in a restarted store's member list
(``relist_self``); the store's host adopts it rather than dropping it as a failed join (``tidy``)."""
_TOKEN_KEY = "RpcGroupManagementToken"
"""Held (compare-and-set) by whoever changes the member list: a join, or the server here."""
_JOIN_BEAT_PREFIX = "rpcps_join_beat/"
"""``rpcps_join_beat/<name>``: a counter member ``name`` raises while its join runs (``beating_while_joining``),
so ``JoinTokenWatch`` tells a slow live join from one that died holding the token."""
JOIN_BEAT_S = 0.5
_token_names = itertools.count()

# Keys of the raw store (not prefixed): rpcps's own.
RANK_COUNTER_KEY = "rpcps/next_rank"
"""Every joining process takes its rank from this counter (ranks are never reused)."""
RANKS_OPEN_KEY = "rpcps/ranks_open"
"""Set by the store's host once joining processes may take ranks (``group.serve``): a restarted
coordinator waits until the live members raised the counter past their own ranks."""
MAX_RANK = 32767
"""TensorPipe ranks are int16."""


class TokenBusy(RuntimeError):
    """A join or leave holds the group token right now; try again shortly."""


def _agent() -> Any:
    """This process's RPC agent, a TensorPipeAgent: its ``store`` and ``_update_group_membership``
    (what dynamic membership reads and calls) are not declared on the base class torch's stubs return."""
    return api._get_current_rpc_agent()


@contextmanager
def _holding_token(dead_holder: str = "") -> Iterator[None]:
    """Takes the group token without waiting, so joins cannot run while the member list changes.

    torch's own helper waits for the token with the store's full timeout (the RPC timeout); a
    reaper blocked there for 30 s behind a dying join used to give up on the member it was
    removing, leaving it listed for good. Here a busy token raises TokenBusy and the caller retries.

    With ``dead_holder``, the token is taken over from that holder (a join that died holding it)
    in one compare-and-set, rather than freed first: a freed token went to the next joiner, which
    was waiting on it, before the dead members it would have called could be removed; that join
    then failed on them too and left the token behind again (a worker refused for want of the job
    secret kept the next one from ever being told so, issue 12's CI runs). The token is released
    with the ``"Done"`` marker torch's waiters poll for, the dead holder's included.
    """
    with _token_of(_agent().store, f"Token_for_rpcps-{os.getpid()}-{next(_token_names)}_join", dead_holder):
        yield


@contextmanager
def _token_of(store: dist.Store, mine: str, dead_holder: str = "") -> Iterator[None]:
    """``_holding_token`` on ``store`` (torch's RPC keys) under the token name ``mine``."""
    holder = store.compare_set(_TOKEN_KEY, dead_holder, mine).decode()
    if holder != mine:
        raise TokenBusy(f"group token held by {holder}")
    try:
        yield
    finally:
        store.set(_TOKEN_KEY, "")
        store.set(mine, "Done")
        if dead_holder:
            store.set(dead_holder, "Done")  # wakes the joins that waited on the dead holder


_HOLDER = re.compile(r"Token_for_(?P<name>\w+_r\d+)_(?:join|leave|prune)")
"""A token held by an RPC member (torch's joins and leaves, ``prune_departed``); rpcps's own holds
(``_holding_token``) name a pid instead and never match."""


def agent_store(store: dist.Store) -> dist.Store:
    """``store`` as the agent that ``init_rpc`` is about to start sees it (under torch's prefix of this
    process's next ``init_rpc``): for changing the group's keys before joining."""
    return dist.PrefixStore(f"rpc_prefix_{torch_rpc._init_counter}", store)  # torch/distributed/rpc/__init__.py


def prune_departed(store: dist.Store, me: str, live: Callable[[], set[str]]) -> list[str]:
    """Before member ``me`` joins: removes the listed members that are not live, and frees the
    group token if one of them died holding it. Returns the names removed.

    In a group whose store no process hosts (etcd), a member that died listed, or died holding the
    token in a join torch does not clean up after (its failed-join path releases nothing), would
    make every later join fail or wait for good unless a joined member's janitor removed it; in a job
    with no other member joined, nobody would. ``store`` is the agent's view (``agent_store``);
    ``live()`` reads the names of the members alive now (etcd keys under each member's own lease),
    twice: after the token's holder is read (a joiner takes its key before it takes the token, so an
    earlier read could take a live holder for dead), and holding the token (a member lists itself
    only holding the token, after taking its key, so every live listed member is in that read). A
    token held by a live member, or taken meanwhile, is left alone: that join finishes, and this one
    waits for it as torch's joins do.
    """
    holder = store.compare_set(_TOKEN_KEY, "", "").decode()  # a read that does not wait
    dead_holder = ""
    if holder:
        match = _HOLDER.fullmatch(holder)
        if match is None or match["name"] == me or match["name"] in live():
            return []
        dead_holder = holder
    try:
        with _token_of(store, f"Token_for_{me}_prune", dead_holder):
            alive = live()
            departed = _unlist(store, lambda name: name not in alive)
    except TokenBusy:
        return []
    if dead_holder:
        logger.warning("took the group token over from %s, whose process is gone", peer_text(dead_holder))
    return departed


def join_token(name: str) -> str:
    """The group token's value while member ``name`` joins (torch's ``_group_membership_management``)."""
    return f"Token_for_{name}_join"


def withdraw_failed_join(store: dist.Store, me: str) -> None:
    """After member ``me``'s join failed: frees the group token if its join or leave still holds it
    (torch's failed-join path releases neither) and takes ``me`` off the member list, so the next
    join neither waits for it nor calls it. ``store`` is the agent's view (``agent_store``)."""
    holder = store.compare_set(_TOKEN_KEY, "", "").decode()
    own = holder if holder in (join_token(me), f"Token_for_{me}_leave") else ""
    if holder and not own:
        return  # another member's join or leave: that one changes the list after ours failed, or never saw us
    with _token_of(store, f"Token_for_{me}_prune", own):
        _unlist(store, lambda name: name == me)


def _unlist(store: dist.Store, drop: Callable[[str], bool]) -> list[str]:
    """Takes every member ``drop`` picks off the store's member list; returns their names. Call
    holding the group token."""
    listed = store.get(_MEMBERS_KEY).decode() if store.check([_MEMBERS_KEY]) else ""
    entries = [e for e in listed.split(",") if e]
    dropped = [e.rpartition("-")[0] for e in entries if drop(e.rpartition("-")[0])]
    if dropped:
        store.set(_MEMBERS_KEY, "".join(f"{e}," for e in entries if e.rpartition("-")[0] not in dropped))
    return dropped


def store_members() -> dict[str, int]:
    """The group's member list as the store has it: name -> rank (torch writes "name-rank," entries)."""
    raw = _agent().store.get(_MEMBERS_KEY).decode()
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


def tidy(names: Iterable[str], dead_holder: str = "") -> tuple[list[str], list[str]]:
    """Removes members ``names`` and every failed join from the group, in one hold of the token.

    A failed join is a listed member this agent never heard of: a join adds its name to the store
    and then tells every member, this process included, all while holding the token; with the token
    held here no join is in progress, so a listed name this agent does not know can only be a join
    that failed (its process is gone or about to exit), unless it put itself back after a restart of
    the store (``relist_self``): then it is adopted. With ``dead_holder`` the token is taken over
    from a join that died holding it (see ``_holding_token``). Returns (the ``names`` that were
    known and removed, the failed joins removed). Raises TokenBusy while a join is in progress.
    """
    with _holding_token(dead_holder):
        removed = [name for name in sorted(names) if _forget_locked(name)]
        _adopt_relisted(set(member_names()))
        known = set(member_names())
        failed = [name for name in store_members() if name not in known]
        for name in failed:
            _forget_locked(name)
        return removed, failed


def _adopt_relisted(known: set[str]) -> list[str]:
    """Makes this agent (the store's host) know every member that put itself back in the member list
    after a restart of the store (``relist_self``); returns their names. Call holding the token."""
    agent = _agent()
    store = agent.store
    adopted = []
    for name, rank in store_members().items():
        if name not in known and store.check([_REJOINED_PREFIX + name]):
            agent._update_group_membership(WorkerInfo(name, rank), [], {}, True)  # reads its address from the store
            store.delete_key(_REJOINED_PREFIX + name)
            adopted.append(name)
    if adopted:
        logger.warning("members back in the group after the store restarted: %s", [peer_text(n) for n in adopted])  # names in the store
    return adopted


def own_address() -> bytes:
    """Where this member's agent listens, as it published it in the store when it joined."""
    return bytes(_agent().store.get(_ADDRESS_PREFIX + my_name()))


def relist_self(address: bytes) -> None:
    """Puts this member back into a restarted store: its address and its member-list entry, under its
    name and rank, so a process that joins later calls it and can be called by it. Raises TokenBusy
    while a join is in progress."""
    agent = _agent()
    me = agent.get_worker_info()
    with _holding_token():
        store = agent.store
        store.set(_ADDRESS_PREFIX + me.name, address)
        store.set(_REJOINED_PREFIX + me.name, "1")
        raw = store.get(_MEMBERS_KEY).decode() if store.check([_MEMBERS_KEY]) else ""
        if me.name not in {e.rpartition("-")[0] for e in raw.split(",") if e}:
            store.set(_MEMBERS_KEY, f"{raw}{me.name}-{me.id},")


def joined() -> bool:
    """Whether this process's agent is up (it joined a group and has not shut down)."""
    return bool(api._is_current_rpc_agent_set())


def unknown_listed() -> list[str]:
    """Members the store lists that this agent does not know: joins in progress, or joins that failed."""
    known = set(member_names())
    return [name for name in store_members() if name not in known]


def forget_here(name: str) -> None:
    """Makes this process's agent forget member ``name``, leaving the store's list as it is (the
    member already took itself off it)."""
    agent = _agent()
    info = next((w for w in agent.get_worker_infos() if w.name == name), None)
    if info is not None:
        agent._update_group_membership(info, [], {}, False)
        logger.debug("forgot %s, which left the RPC group", peer_text(name))


def _forget_locked(name: str) -> bool:
    agent = _agent()
    forgotten = False
    info = next((w for w in agent.get_worker_infos() if w.name == name), None)
    if info is not None:
        agent._update_group_membership(info, [], {}, False)
        forgotten = True
    if _unlist(agent.store, lambda listed: listed == name):
        forgotten = True
    if forgotten:
        logger.info("removed %s from the RPC group", peer_text(name))  # a name in the store, or one a peer asked to drop
    return forgotten


_leave_secret: JobSecret | None = None


def require_leave_proofs(secret: JobSecret | None) -> None:
    """From now on ``forget_me`` drops only members that prove they hold ``secret`` (None: anyone)."""
    global _leave_secret
    _leave_secret = secret


def forget_me(name: str, proof: str = "") -> str:
    """Runs on the store's host at a departing member's request (see ``group.leave``).

    With a job secret, the caller must prove it (``JobSecret.leave_proof``): otherwise any peer
    could drop any member from the group. Returns 'done', 'unknown', 'busy' or 'refused' rather
    than raising, so the caller can retry a busy token without parsing a remote traceback.
    """
    secret = _leave_secret
    if secret is not None and not matches(secret.leave_proof(str(name)), proof):
        logger.warning("refused a request to drop '%s' from the RPC group: no valid job-secret proof", peer_text(name))
        return "refused"
    try:
        return "done" if forget_member(name) else "unknown"
    except TokenBusy:
        return "busy"


def guarded_update_group_membership(worker_info: Any, my_devices: Any, reverse_device_map: Any, is_join: bool) -> Any:
    """Stands in for torch's ``_update_group_membership`` when a peer calls it (see ``protection``).

    A joining process calls it on every member while it holds the group's join token. torch's
    graceful shutdown calls it with ``is_join=False``, which rpcps never uses (it shuts down
    non-gracefully and leaves through ``forget_me``). Unguarded, any peer could evict any member or
    add a fake one; the token check stops a peer that does not take the token (the store is
    unauthenticated, so it cannot stop one that does).
    """
    if is_join is not True:
        raise PermissionError("leaving the RPC group through _update_group_membership is refused here")
    holder = _agent().store.compare_set(_TOKEN_KEY, "", "").decode()  # reads without changing it
    if holder != f"Token_for_{worker_info.name}_join":
        raise PermissionError(f"{worker_info.name} does not hold the group's join token; refused")
    return _utils._update_group_membership(worker_info, my_devices, reverse_device_map, is_join)


class JoinTokenWatch:
    """Finds the group's join token held by a process that died holding it.

    A process killed in the middle of its join (or whose join failed) never releases the token, and
    every later join then waits on it forever. A holder is dead once it has held the token for
    ``max_age_s`` without its join beat (``beating_while_joining``) moving; the caller then takes the
    token over (``tidy(..., dead_holder)``). The beat, not the age alone: a live join slower than
    ``max_age_s`` (a member slow to answer it, a loaded host) lost its token to the takeover and
    failed ("does not hold the group's join token", CI's coordinator-restart test). A holder that
    does not beat (torch's own joins, rpcps's short holds) is judged by its age alone, and one that
    beats is given ``beating_max_age_s`` at most: the store has no authentication, and a stranger
    that held the token and beat must not keep every join out for good.
    """

    def __init__(self, max_age_s: float, beating_max_age_s: float = 60.0) -> None:
        self.max_age_s = max_age_s
        self.beating_max_age_s = beating_max_age_s
        self._seen: tuple[str, float] | None = None
        """(holder, when it was first seen holding the token)."""
        self._beat: tuple[bytes | None, float] | None = None
        """(its beat, when the beat was first seen at that value)."""

    def stale_holder(self, now: float) -> str:
        """The token's holder when it has held the token past its age (above); "" otherwise."""
        store = _agent().store
        holder = store.compare_set(_TOKEN_KEY, "", "").decode()  # reads without changing it
        if not holder:
            self._seen = self._beat = None
            return ""
        beat = _join_beat(store, holder)
        if self._seen is None or self._seen[0] != holder:
            self._seen, self._beat = (holder, now), (beat, now)
            return ""
        if self._beat is None or self._beat[0] != beat:
            self._beat = (beat, now)
        silent = now - self._beat[1] >= self.max_age_s
        return holder if silent or now - self._seen[1] >= self.beating_max_age_s else ""


def _join_beat(store: dist.Store, holder: str) -> bytes | None:
    match = _HOLDER.fullmatch(holder)
    if match is None:
        return None
    key = _JOIN_BEAT_PREFIX + match["name"]
    return store.get(key) if store.check([key]) else None


@contextmanager
def beating_while_joining(store: dist.Store, name: str) -> Iterator[None]:
    """While this process joins the group as ``name``: raises its join beat every ``JOIN_BEAT_S``
    (see ``JoinTokenWatch``). ``store`` is a client of its own (the join's is busy joining), seen as
    the agent will see it (``agent_store``)."""
    key = _JOIN_BEAT_PREFIX + name

    def beat() -> None:
        try:
            store.add(key, 1)
        except (RuntimeError, dist.DistError) as e:  # the watch then judges this join by its age alone
            logger.debug("join beat: %s", e)

    beat()
    beats = Periodic("join-beat", JOIN_BEAT_S, beat)
    beats.start()
    try:
        yield
    finally:
        beats.stop(timeout_s=JOIN_BEAT_S * 4)
        try:
            store.delete_key(key)
        except (RuntimeError, dist.DistError) as e:
            logger.debug("join beat: could not remove %s: %s", key, e)


def my_name() -> str:
    return _agent().get_worker_info().name


def my_rank() -> int:
    return int(_agent().get_worker_info().id)


def highest_known_rank() -> int:
    """The highest rank this process's agent maps to a process (its own, or a peer's it has not dropped)."""
    agent = _agent()
    return max([int(agent.get_worker_info().id), *(int(w.id) for w in agent.get_worker_infos())])


def member_names() -> list[str]:
    return [w.name for w in _agent().get_worker_infos()]


REPAIR_KINDS = ("members", "address", "rank_counter")
"""What ``StoreKeeper`` puts back (a metric label)."""


@dataclass(frozen=True)
class Repair:
    """One thing ``StoreKeeper`` found changed in the store and put back."""

    what: str
    """One of ``REPAIR_KINDS``."""
    detail: str


class StoreKeeper:
    """Puts back what a stranger changed in the group's store (run on the store's host: the
    coordinator, or the server that embeds the store).

    The store has no authentication: one ``set`` used to block every later join for good. Checked
    (``check``, every second from ``ps.lifecycle.store_guard``):

    - the member list holds every member this agent knows, under its rank, and nothing unparsable
      (checked while holding the group token, when no join can be changing it; names the agent does
      not know are left for the reaper, which drops them as failed joins);
    - every known member's address is the one it published when it joined (this server's own
      from the start), keyed by (name, rank) so a restarted shard's new address is its own;
    - the rank counter moves forward and by a plausible step: set back, or thrown to its limit, it
      would hand out ranks already taken or none at all.
    """

    MAX_RANK_STEP = 1024
    """More ranks than this handed out between two checks (a second apart) is not joins but tampering."""

    def __init__(self) -> None:
        agent = _agent()
        self._store = agent.store
        self._raw = agent.store.underlying_store
        self._addresses: dict[tuple[str, int], bytes] = {}
        self._seen_rank = self._rank_counter()
        self._ranks_open_seen = False
        self._remember_addresses(self._known())

    def check(self) -> list[Repair]:
        known = self._known()
        repairs = self._check_addresses(known) + self._check_rank_counter(known)
        try:
            with _holding_token():
                repairs += self._check_members(self._known())
        except TokenBusy:
            pass  # a join is changing the list right now; the next check sees its result
        return repairs

    def _known(self) -> dict[str, int]:
        return {w.name: w.id for w in _agent().get_worker_infos()}

    def _get(self, key: str) -> bytes | None:
        # get() on a missing key blocks for the store's timeout; check first.
        return self._store.get(key) if self._store.check([key]) else None

    def _remember_addresses(self, known: dict[str, int]) -> None:
        for name, rank in known.items():
            if (name, rank) not in self._addresses:
                address = self._get(_ADDRESS_PREFIX + name)
                if address:
                    self._addresses[(name, rank)] = address

    def _check_addresses(self, known: dict[str, int]) -> list[Repair]:
        self._addresses = {k: v for k, v in self._addresses.items() if known.get(k[0]) == k[1]}
        repairs = []
        for (name, _), address in self._addresses.items():
            now = self._get(_ADDRESS_PREFIX + name)
            if now != address:
                self._store.set(_ADDRESS_PREFIX + name, address)
                repairs.append(Repair("address", f"{name}'s address was {_show(now)}; put back {_show(address)}"))
        self._remember_addresses(known)
        return repairs

    def _rank_counter(self) -> int:
        return int(self._raw.add(RANK_COUNTER_KEY, 0))

    def _check_rank_counter(self, known: dict[str, int]) -> list[Repair]:
        repairs = self._check_ranks_open()
        # Every member took its rank from the counter, so it is at least the highest known rank, or
        # listed by a member back after a restart of the store (it raises the counter once listed).
        floor = max(self._seen_rank, *known.values(), *self._relisted_ranks(known))
        now = self._rank_counter()
        if floor <= now <= min(floor + self.MAX_RANK_STEP, MAX_RANK):
            self._seen_rank = now
            return repairs
        self._raw.set(RANK_COUNTER_KEY, str(floor))
        self._seen_rank = floor
        return [*repairs, Repair("rank_counter", f"the rank counter was set to {now}; put back {floor}")]

    def _check_ranks_open(self) -> list[Repair]:
        # Deleted once it was set, every later join would wait for it until its deadline.
        if self._raw.check([RANKS_OPEN_KEY]):
            self._ranks_open_seen = True
            return []
        if not self._ranks_open_seen:
            return []  # not yet: a restarted coordinator opens ranks after a grace (group.serve)
        self._raw.set(RANKS_OPEN_KEY, "1")
        return [Repair("rank_counter", "the key that lets joining processes take ranks was deleted; put back")]

    def _relisted_ranks(self, known: dict[str, int]) -> list[int]:
        return [rank for name, rank in store_members().items() if name not in known and self._store.check([_REJOINED_PREFIX + name])]

    def _check_members(self, known: dict[str, int]) -> list[Repair]:
        raw = self._get(_MEMBERS_KEY)
        entries = [e for e in (raw or b"").decode(errors="replace").split(",") if e]
        parsed: dict[str, int] = {}
        garbage = []
        for entry in entries:
            name, sep, rank = entry.rpartition("-")
            if not sep or not name or "-" in name or not rank.isdigit() or name in parsed:
                garbage.append(entry)
            else:
                parsed[name] = int(rank)
        wrong = sorted(n for n, r in known.items() if parsed.get(n) != r)
        if not wrong and not garbage:
            return []
        strangers = {n: r for n, r in parsed.items() if n not in known}  # failed joins: the reaper's
        members = sorted({**strangers, **known}.items(), key=lambda item: item[1])
        self._store.set(_MEMBERS_KEY, "".join(f"{name}-{rank}," for name, rank in members))
        return [Repair("members", f"the member list lacked or misstated {wrong} and held {len(garbage)} unparsable entries; rewrote it")]


def _show(value: bytes | None) -> str:
    """A store value for a ``Repair`` (logged): anyone can write the store, so it is escaped and capped."""
    return "deleted" if value is None else f"'{peer_text(value.decode(errors='replace'), 80)}'"


def ranks_handed_out() -> int | None:
    """The group's rank counter (each joining process takes one); None when the store does not answer."""
    try:
        return int(_agent().store.underlying_store.add(RANK_COUNTER_KEY, 0))
    except (RuntimeError, ValueError) as e:
        logger.debug("could not read the rank counter: %s", e)
        return None
