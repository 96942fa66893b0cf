"""``rpcps reshard``: rewrites a stopped job's --checkpoint-dir for another --shards, crash-safely.

Reads the newest valid snapshot of every old shard (an invalid one is skipped and logged, never
moved: this directory is not ours to tidy until the conversion commits), redistributes them
(ps/checkpoints/reshard.py), writes one snapshot per new shard with the usual commit protocol
(ps/checkpoints/snapshot_files.py), then moves the old layout aside into ``resharded-from-S-<unix time>/``,
where it stays until the user deletes it. Sparse tables: every old shard's chain is read, and each
new shard's snapshot holds all of their rows in its ``state.pt`` (each new server keeps its own
buckets at restore; its first snapshot is a full of only those, and the purge drops this one later).

Crash safety: a journal ``reshard.json`` is written (durably) before anything else and removed
last. While it exists no server resumes from the directory (``shard_checkpoint_config`` refuses,
naming the command to run again); running the same command again finishes the job: in the
"writing" phase it rewrites every new snapshot from the untouched old layout, in the "moving" phase
it moves what is left of the old layout aside.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ps.checkpoints.reshard import OldShard, ReshardRefused, reshard
from ps.checkpoints.snapshot_files import (
    FINISHED_FILE,
    PREFIX,
    InvalidSnapshot,
    Signer,
    fsync_dir,
    list_snapshots,
    load_snapshot,
    write_json_durably,
    write_snapshot,
)
from ps.checkpoints.sparse_checkpoint import MANIFEST_KEY, TableChains, as_chains, read_chain
from rpcps.partition import partition_digest, shard_signature
from rpcps.signature import DEFAULT_CHUNK_BYTES, ModelSignature

logger = logging.getLogger(__name__)

JOURNAL = "reshard.json"


@dataclass(frozen=True)
class Resharded:
    """What one conversion did."""

    old_count: int
    new_count: int
    version: int
    sources: tuple[Path, ...]
    written: tuple[Path, ...]
    aside: Path


def layout_dir(root: Path, index: int, count: int) -> Path:
    """Where shard ``index`` of ``count`` keeps its snapshots: ``root`` itself for one server."""
    return root if count == 1 else root / f"shard-{index}-of-{count}"


def layouts(root: Path) -> dict[int, dict[int, Path]]:
    """Shard count -> shard index -> directory, for every layout that holds snapshots under ``root``."""
    found: dict[int, dict[int, Path]] = {}
    if list_snapshots(root):
        found[1] = {0: root}
    for p in root.glob("shard-*-of-*") if root.is_dir() else []:
        parts = p.name.split("-")
        if len(parts) == 4 and parts[1].isdigit() and parts[3].isdigit() and p.is_dir() and list_snapshots(p):
            found.setdefault(int(parts[3]), {})[int(parts[1])] = p
    return found


def journal_of(root: Path) -> dict[str, Any] | None:
    """The unfinished conversion's journal, or None. Raises ReshardRefused when it is unreadable."""
    try:
        journal = json.loads((root / JOURNAL).read_text())
        return {"from": int(journal["from"]), "to": int(journal["to"]), "aside": str(journal["aside"]), "phase": str(journal["phase"])}
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ReshardRefused(f"{root / JOURNAL} is unreadable ({e}); inspect the directory by hand") from None


def reshard_directory(root: Path, shards: int, verify: Signer | None = None, sign: Signer | None = None) -> Resharded:
    """Rewrites the checkpoint directory ``root`` for ``shards`` servers (the module's protocol).

    Raises:
        ReshardRefused: nothing to do, an ambiguous or incomplete layout, an unfinished conversion to
            another count, no valid snapshot of a shard, or states that cannot be redistributed.
        OSError: a write failed (the journal stays; run the same command again).
    """
    if shards < 1:
        raise ReshardRefused(f"--shards must be >= 1, got {shards}")
    journal = journal_of(root)
    prepared: _Prepared | None = None
    if journal is None:
        found = layouts(root)
        if len(found) != 1:
            what = f"snapshots of {sorted(found)} shard counts" if found else "no snapshot"
            raise ReshardRefused(f"{root} holds {what}; rpcps reshard converts the checkpoint directory of one stopped job")
        (old_count, dirs), = found.items()
        if old_count == shards:
            raise ReshardRefused(f"{root} already holds snapshots of {shards} shard(s); nothing to do")
        absent = sorted(set(range(old_count)) - set(dirs))
        if absent:
            raise ReshardRefused(f"{root} is a checkpoint of {old_count} shards but holds none of shard(s) {absent}")
        # Everything is read and checked before the journal exists: a refusal leaves the directory as it was.
        prepared = _prepare([layout_dir(root, k, old_count) for k in range(old_count)], shards, verify)
        journal = {"from": old_count, "to": shards, "aside": f"resharded-from-{old_count}-{int(time.time())}", "phase": "writing"}
        write_json_durably(root / JOURNAL, journal)
    elif journal["to"] != shards:
        raise ReshardRefused(
            f"{root} holds an unfinished conversion to {journal['to']} shard(s); finish it first: rpcps reshard "
            f"--checkpoint-dir {root} --shards {journal['to']}"
        )
    old_count, aside = journal["from"], root / journal["aside"]
    old_dirs = [layout_dir(root, k, old_count) for k in range(old_count)]
    if journal["phase"] == "writing":
        prepared = prepared or _prepare(old_dirs, shards, verify)
        written = _write(root, prepared, sign)
        sources = list(prepared.sources)
        journal["phase"] = "moving"
        write_json_durably(root / JOURNAL, journal)
    else:  # the new snapshots are committed; only the move aside was interrupted
        sources = []
        written = [list_snapshots(layout_dir(root, k, shards))[0] for k in range(shards)]
    _move_aside(root, old_dirs, old_count, aside)
    (root / JOURNAL).unlink()
    fsync_dir(root)
    version = int(written[0].name.removeprefix(PREFIX))
    logger.info("resharded %s from %d to %d shard(s) at version %d; the old layout is in %s", root, old_count, shards, version, aside)
    return Resharded(old_count, shards, version, tuple(sources), tuple(written), aside)


@dataclass(frozen=True)
class _Prepared:
    """The new shards' states and manifests, computed and checked, not written yet."""

    states: list[dict[str, Any]]
    metas: list[dict[str, Any]]
    finished: dict[int, int]
    sources: tuple[Path, ...]


def _prepare(old_dirs: list[Path], shards: int, verify: Signer | None) -> _Prepared:
    """Reads every old shard's newest valid snapshot and redistributes them; raises ReshardRefused."""
    loaded = [_newest_valid(d, verify) for d in old_dirs]
    signed = [str(path) for manifest, _, path in loaded if "hmac" in manifest]
    if signed and verify is None:
        # Unchecked, and the new snapshots would be unsigned: a server with --sign-checkpoints refuses those.
        raise ReshardRefused(
            f"{signed[0]} is signed (the job runs with --sign-checkpoints): run rpcps reshard with --sign-checkpoints "
            "--job-secret-file F, the job's secret, to check the old snapshots and sign the new ones"
        )
    first = loaded[0][0]
    if len(old_dirs) > 1 and "model_signature" not in first:
        raise ReshardRefused(f"{loaded[0][2]} does not record the whole model's signature (written by an older rpcps)")
    model = ModelSignature.from_wire(first.get("model_signature") or first.get("signature", []))
    for k, (manifest, _, path) in enumerate(loaded):
        expected = {"shard_index": k, "shard_count": len(old_dirs), "optimizer": first.get("optimizer"),
                    "partition_digest": partition_digest(model, len(old_dirs)), "model_signature": first.get("model_signature")}
        wrong = {key: manifest.get(key) for key, value in expected.items() if manifest.get(key, value) != value}
        if wrong:
            raise ReshardRefused(f"{path} does not belong with {loaded[0][2]} ({sorted(wrong)} differ); was a directory copied in?")
    chunk_bytes = int(first.get("config", {}).get("core", {}).get("chunk_bytes", DEFAULT_CHUNK_BYTES))
    sparse = _merged_sparse(loaded, verify)
    states = reshard(model, [OldShard(k, state, str(path)) for k, (_, state, path) in enumerate(loaded)], shards, chunk_bytes)
    if sparse is not None:
        for state in states:
            state["sparse"] = sparse
    sources = [path for _, _, path in loaded]
    metas = [_meta(first, model, k, shards, sources) for k in range(shards)]
    return _Prepared(states, metas, _common_finished(old_dirs), tuple(sources))


def _write(root: Path, prepared: _Prepared, sign: Signer | None) -> list[Path]:
    """Commits one snapshot per new shard (and its finished slots); returns their paths."""
    written = []
    shards = len(prepared.states)
    for k, (state, meta) in enumerate(zip(prepared.states, prepared.metas)):
        directory = layout_dir(root, k, shards)
        directory.mkdir(exist_ok=True)
        written.append(write_snapshot(directory, int(state["version"]), state, meta, sign=sign).path)
        if prepared.finished:
            write_json_durably(directory / FINISHED_FILE, {str(s): n for s, n in sorted(prepared.finished.items())})
    return written


def _newest_valid(directory: Path, verify: Signer | None) -> tuple[dict[str, Any], dict[str, Any], Path]:
    problems = []
    for path in list_snapshots(directory):
        try:
            manifest, state = load_snapshot(path, verify)
            return manifest, state, path
        except InvalidSnapshot as e:
            logger.warning("skipping snapshot %s: %s", path, e)
            problems.append(f"{path.name}: {e}")
    raise ReshardRefused(f"no valid snapshot in {directory} ({'; '.join(problems)}); restore one from a backup")


def _merged_sparse(loaded: list[tuple[dict[str, Any], dict[str, Any], Path]], verify: Signer | None) -> TableChains | None:
    """Every old shard's sparse chains, merged per table (None for a model without sparse tables)."""
    merged: TableChains = {}
    for manifest, state, path in loaded:
        if MANIFEST_KEY in manifest:
            try:
                tables = read_chain(path, manifest, verify)
            except InvalidSnapshot as e:
                raise ReshardRefused(f"the sparse tables of {path}: {e}") from None
        elif "sparse" in state:
            tables = as_chains(state.pop("sparse"))
        else:
            continue
        for name, chains in tables.items():
            merged.setdefault(name, []).extend(chains)
    return merged or None


def _common_finished(old_dirs: list[Path]) -> dict[int, int]:
    """Slots every old shard recorded as finished with the same step count (a slot finished on some
    shards only did not finish: its worker had not made its steps durable everywhere)."""
    records = []
    for d in old_dirs:
        try:
            records.append({int(s): int(n) for s, n in json.loads((d / FINISHED_FILE).read_text()).items()})
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as e:
            logger.warning("cannot read %s (%s): no slot counts as finished after the reshard", d / FINISHED_FILE, e)
            return {}
    return {s: n for s, n in records[0].items() if all(r.get(s) == n for r in records)}


def _meta(first: dict[str, Any], model: ModelSignature, index: int, count: int, sources: list[Path]) -> dict[str, Any]:
    """A new shard's manifest fields, as the server writes them (ps.runner._meta), and where they came from."""
    config = dict(first.get("config", {}))
    config["core"] = {**config.get("core", {}), "shard_index": index, "shard_count": count}
    skip = {"format", "version", "created_unix", "files", "hmac", MANIFEST_KEY, "resharded_from"}
    return {
        **{k: v for k, v in first.items() if k not in skip},
        "signature": shard_signature(model, count, index).to_wire(),
        "shard_index": index,
        "shard_count": count,
        "partition_digest": partition_digest(model, count),
        "config": config,
        "resharded_from": [str(p) for p in sources],
    }


def _move_aside(root: Path, old_dirs: list[Path], old_count: int, aside: Path) -> None:
    """Moves the old layout under ``aside`` (what is still in place: this may be a second run)."""
    aside.mkdir(exist_ok=True)
    if old_count == 1:  # the old snapshots are root's own step-* directories (and its finished.json)
        moving: list[Path] = [p for p in list_snapshots(root)]
        moving += [p for p in (root / FINISHED_FILE,) if p.exists()]
    else:
        moving = [d for d in old_dirs if d.exists()]
    for path in moving:
        os.rename(path, aside / path.name)
