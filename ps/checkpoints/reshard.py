"""Resharding: the captured states of S server shards turned into the states of S' shards (pure logic).

Each new shard gets the parameters ``rpcps.partition`` gives it for S' shards, the same rule a fresh
start uses. The server steps its optimizer over flat chunks (ps/core/optim.py), so optimizer state is
moved element by element: a state tensor shaped like its chunk is cut at the parameters' offsets in
the old chunk and packed at their offsets in the new one, bit for bit. Any other state of a chunk
(Adam's ``step``, a 0-dim tensor) is one value per chunk: every parameter packed into a new chunk
must bring the same value, else the move is refused (the new chunk could not step them alike).

Per-shard progress, the rule (docs/FAULT_TOLERANCE.md, "Resharding"):
- every worker slot's record of processed steps (its dedup tracker) must be **the same on every old
  shard**: a new shard holds parameters of several old ones, and a step that one of them applied
  and another did not could then be neither applied once more (double on the first) nor skipped
  (lost on the second). Equal records are exactly what a graceful stop leaves (workers drain their
  pushes to every shard before the servers stop). Each new shard gets that record, so a retried or
  recomputed push of a step any old shard processed is answered 'duplicate';
- the version of every new shard is the **largest** old version (versions never go backwards, and
  they differ only by pushes refused on one shard and not another), the replication epoch likewise;
- the learning-rate schedule and the optimizer's settings must be equal on every old shard;
- shard 0 keeps the model's buffers (they live on shard 0 at any count); sparse tables are not
  handled here: the caller hands every new shard all of them, and each keeps its own buckets at
  restore (``SparseStore.restore``).

What must not live here: reading and writing snapshot directories (ps/checkpoints/reshard_files.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from rpcps.partition import shard_signature
from rpcps.signature import FlatLayout, ModelSignature

KNOWN_KEYS = frozenset({"masters", "optimizer", "schedule", "version", "epoch", "workers", "buffers", "sparse"})
"""What ``ParameterServer.capture_state_locked`` puts in a state; anything else is refused, not dropped."""


class ReshardRefused(ValueError):
    """The old shards' states cannot be redistributed (the message says why and what to do)."""


@dataclass(frozen=True)
class OldShard:
    """One old shard's captured state and where it came from (for messages)."""

    index: int
    state: dict[str, Any]
    where: str


@dataclass(frozen=True)
class _Param:
    """One parameter's values and its optimizer state, cut out of its old chunk."""

    values: torch.Tensor
    elementwise: dict[str, torch.Tensor]
    per_chunk: dict[str, Any]
    origin: str


def reshard(model: ModelSignature, old: list[OldShard], new_count: int, chunk_bytes: int) -> list[dict[str, Any]]:
    """The states of ``new_count`` shards holding exactly what the ``old`` shards hold.

    Args:
        model: the whole model's signature (the partition depends on it and the shard count only).
        old: every old shard's state, in shard order.
        new_count: S'.
        chunk_bytes: the servers' chunk size (``--chunk-mb``), which fixes the flat layout.

    Returns:
        One state per new shard, in shard order, loadable by ``ParameterServer.restore_state``
        (without sparse tables).

    Raises:
        ReshardRefused: the old states disagree on progress, settings or per-chunk optimizer state,
            or do not hold what their partition says.
    """
    count = len(old)
    if [s.index for s in old] != list(range(count)):
        raise ReshardRefused(f"need every old shard 0..{count - 1} in order, got {[s.index for s in old]}")
    for shard in old:
        unknown = set(shard.state) - KNOWN_KEYS
        if unknown:
            raise ReshardRefused(f"{shard.where} holds {sorted(unknown)}, which this rpcps cannot redistribute; use the rpcps that wrote it")
    workers = _common_progress(old)
    group = _common(old, lambda s: _settings(s.state["optimizer"]), "optimizer settings (--optimizer-args, or the learning rate a schedule set)")
    schedule = _common(old, lambda s: s.state.get("schedule"), "learning-rate schedule state")
    params: dict[str, _Param] = {}
    for shard in old:
        params.update(_cut(shard, shard_signature(model, count, shard.index), chunk_bytes))
    version = max(int(s.state["version"]) for s in old)
    epoch = max(int(s.state.get("epoch", 0)) for s in old)
    states = []
    for index in range(new_count):
        layout = FlatLayout(shard_signature(model, new_count, index), chunk_bytes)
        masters, optimizer_state = _pack(layout, params)
        state: dict[str, Any] = {
            "masters": masters,
            "optimizer": {"state": optimizer_state, "param_groups": [{**group, "params": list(range(len(layout)))}]},
            "schedule": schedule,
            "version": version,
            "epoch": epoch,
            "workers": workers,
        }
        if index == 0 and "buffers" in old[0].state:
            state["buffers"] = old[0].state["buffers"]
        states.append(state)
    return states


def _common_progress(old: list[OldShard]) -> dict[str, dict[str, Any]]:
    """Every slot's dedup record, which must be the same on every old shard (the module's rule)."""
    slots = sorted({int(slot) for s in old for slot in s.state["workers"]})
    empty = {"floor": -1, "above": []}
    common = {}
    for slot in slots:
        records = [_record(s.state["workers"].get(str(slot), empty)) for s in old]
        if any(r != records[0] for r in records):
            held = ", ".join(f"shard {s.index} through step {r['floor']}" + (f" and {r['above']}" if r["above"] else "")
                             for s, r in zip(old, records))
            raise ReshardRefused(
                f"worker slot {slot} is not at the same step on every shard ({held}): a step applied on one shard and not "
                "another can be neither applied again nor skipped once their parameters share a shard. Resume with the old "
                "--shards and stop the job gracefully (SIGTERM to rpcps local, or rpcps ctl shutdown to every shard: workers "
                "first drain their pushes to every shard), or let the workers finish; then reshard"
            )
        common[str(slot)] = records[0]
    return common


def _record(tracker: dict[str, Any]) -> dict[str, Any]:
    return {"floor": int(tracker["floor"]), "above": sorted(int(s) for s in tracker["above"])}


def _settings(optimizer: dict[str, Any]) -> dict[str, Any]:
    groups = optimizer["param_groups"]
    if len(groups) != 1:
        raise ReshardRefused(f"expected the server's one optimizer parameter group, got {len(groups)}")
    return {k: v for k, v in groups[0].items() if k != "params"}


def _common(old: list[OldShard], get: Callable[[OldShard], Any], what: str) -> Any:
    """``get`` of every old shard, which must be equal on all of them."""
    values = [get(s) for s in old]
    for shard, value in zip(old[1:], values[1:]):
        if not _same(value, values[0]):
            raise ReshardRefused(
                f"{what} differs between shard 0 ({old[0].where}) and shard {shard.index} ({shard.where}): one new shard "
                "cannot hold both. Resume with the old --shards"
            )
    return values[0]


def _same(a: Any, b: Any) -> bool:
    """Equal values, tensors compared bit for bit (dtype and shape included)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
            and bool(torch.equal(a, b))
        )
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return bool(a == b)


def _cut(shard: OldShard, signature: ModelSignature, chunk_bytes: int) -> dict[str, _Param]:
    """Each parameter of an old shard with its slice of its chunk's optimizer state."""
    layout = FlatLayout(signature, chunk_bytes)
    masters = shard.state["masters"]
    if [int(m.numel()) for m in masters] != list(layout.chunk_numels):
        raise ReshardRefused(
            f"{shard.where}: its parameter chunks ({[int(m.numel()) for m in masters]} elements) do not match shard "
            f"{shard.index}'s partition ({list(layout.chunk_numels)}); a different model or --chunk-mb wrote it"
        )
    chunk_state = shard.state["optimizer"]["state"]
    cut = {}
    for slot, values in zip(layout.slots, layout.views(masters)):
        state = chunk_state.get(slot.chunk, {})
        numel = layout.chunk_numels[slot.chunk]
        elementwise = {
            k: v[slot.offset : slot.offset + slot.spec.numel] for k, v in state.items() if _is_elementwise(v, numel)
        }
        per_chunk = {k: v for k, v in state.items() if k not in elementwise}
        cut[slot.spec.name] = _Param(values.reshape(-1), elementwise, per_chunk, f"shard {shard.index} ({shard.where})")
    return cut


def _is_elementwise(value: Any, chunk_numel: int) -> bool:
    """A state tensor with one element per element of its chunk (a 0-dim ``step`` is per chunk)."""
    return isinstance(value, torch.Tensor) and value.dim() == 1 and value.numel() == chunk_numel


def _pack(layout: FlatLayout, params: dict[str, _Param]) -> tuple[list[torch.Tensor], dict[int, dict[str, Any]]]:
    """A new shard's chunks and their optimizer state, from the parameters it owns."""
    masters = layout.empty_chunks()
    members: dict[int, list[tuple[int, _Param]]] = {}
    for slot, view in zip(layout.slots, layout.views(masters)):
        param = params[slot.spec.name]
        view.copy_(param.values.view(view.shape))
        members.setdefault(slot.chunk, []).append((slot.offset, param))
    state: dict[int, dict[str, Any]] = {}
    for chunk, parts in members.items():
        first = parts[0][1]
        for _, param in parts[1:]:
            if param.elementwise.keys() != first.elementwise.keys() or not _same(param.per_chunk, first.per_chunk):
                raise ReshardRefused(
                    f"new chunk {chunk} would pack parameters whose optimizer state differs beyond their values "
                    f"({first.origin}: {_describe(first)}; {param.origin}: {_describe(param)}), e.g. Adam at different step "
                    "counts: the old shards stopped at different versions. Resume with the old --shards until they agree"
                )
        if not first.elementwise and not first.per_chunk:
            continue  # no state yet (no update applied): the optimizer creates it at the first step
        numel = layout.chunk_numels[chunk]
        # Cloned: torch steps a 0-dim ``step`` in place, and new chunks cut from one old chunk would
        # otherwise share it (and step it once per chunk; torch.save keeps such sharing too).
        packed: dict[str, Any] = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in first.per_chunk.items()}
        for key, sample in first.elementwise.items():
            flat = torch.empty(numel, dtype=sample.dtype)
            for offset, param in parts:
                part = param.elementwise[key]
                flat[offset : offset + part.numel()] = part
            packed[key] = flat
        state[chunk] = packed
    return masters, state


def _describe(param: _Param) -> str:
    return f"elementwise {sorted(param.elementwise)}, per chunk {param.per_chunk}"
