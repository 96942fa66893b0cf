"""A character-level (byte-level) transformer language model trained on the Python standard library.

No download: the text is the ``.py`` source of the running interpreter's own standard library
(``sysconfig.get_paths()["stdlib"]``), so every machine with Python has it. It is **not the same text
everywhere**: the standard library changes between Python versions (3.12 dropped ``distutils``, for
one) and distributions patch it, so figures are comparable only between runs on the same interpreter.
``Corpus.digest`` names the text a run used.

The corpus: the ``.py`` files in a fixed pseudo-random order (sorted by the SHA-256 of their relative
path, so the first few MB sample the whole library rather than its first letters), leaving out
tests, installed packages and generated files (``_LEFT_OUT_DIRS``, ``_sysconfigdata*``). Each file
goes wholly to training or to held-out by a CRC-32 of its relative path (about one file in ten is
held out), so held-out text is never seen in training. Each file gives at most its first
``FILE_BYTES`` (one 750 KB generated file would otherwise be a quarter of the text), and files are
read until ``TRAIN_BYTES`` and ``HELD_OUT_BYTES`` are full, which keeps the corpus a few MB and the
same on every run of one interpreter. A file that cannot be read is skipped, logged and counted in
``Corpus.skipped``.

The vocabulary is the 256 byte values, so nothing is unknown and "bits per character" is bits per
byte (the standard library is nearly all ASCII, where the two are the same).

    rpcps local --workers 2 --steps 400 --model rpcps.examples.charlm:model \\
        --data rpcps.examples.charlm:data --loss cross_entropy \\
        --optimizer adam --lr 0.001

The model returns logits already flattened to (B*T, 256) and the data's targets are (B*T,), so the
built-in ``cross_entropy`` loss applies as is; ``loss`` below is the same function under this module's
name.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import math
import os
import sysconfig
import zlib
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from rpcps.examples.evaluation import score
from rpcps.examples.recipe import Recipe
from rpcps.examples.stream import Batch, ShardedStream

logger = logging.getLogger(__name__)

VOCAB = 256
CONTEXT = 128
BATCH_SIZE = 32
EVAL_BATCH_SIZE = 64
TRAIN_BYTES = 3_000_000
HELD_OUT_BYTES = 131_072
"""Held-out text scored by ``evaluate``: 1023 windows of 128 bytes, about a second on two cores."""
FILE_BYTES = 32_768
HELD_OUT_PERCENT = 10
MODEL_SEED = 0
DATA_SEED = 0
RECIPE = Recipe(optimizer="adam", lr=1e-3, steps=400)
"""Measured with bench/reference_train.py (Python 3.11.7 stdlib): held-out 8.0 bits/char untrained, 4.2-4.3
after 100 steps, 3.2 after 400 (~45 s on two cores), 2.4 after 1000. Over 400 steps 1e-3 beats 5e-4
(3.46), 2e-3 (3.27) and 3e-3 (3.39); the larger rates fall faster only in the first ~100 steps."""

# Tests hold deliberately odd data (bad encodings, huge literals); installed packages are not the
# standard library; encodings/ is mostly generated codec tables, text a model learns nothing from.
_LEFT_OUT_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test", "encodings"})

loss = F.cross_entropy


@dataclass(frozen=True)
class Corpus:
    train: torch.Tensor
    """Training bytes, uint8, files concatenated in corpus order."""
    held_out: torch.Tensor
    """Held-out bytes, uint8, from files that contribute nothing to ``train``."""
    train_files: tuple[str, ...]
    held_out_files: tuple[str, ...]
    skipped: int
    """Files that could not be read."""

    @property
    def digest(self) -> str:
        """Names the text: equal digests mean two machines trained and scored on the same bytes."""
        h = hashlib.sha256(self.train.numpy().tobytes())
        h.update(self.held_out.numpy().tobytes())
        return h.hexdigest()[:16]


def is_held_out(relative_path: str) -> bool:
    # CRC-32 rather than hash(): str hashes are salted per process (PYTHONHASHSEED), the split must not be.
    return zlib.crc32(relative_path.encode()) % 100 < HELD_OUT_PERCENT


def source_files(root: Path) -> list[str]:
    """The relative POSIX paths of the ``.py`` files under ``root`` that the corpus may use, in corpus order."""
    found: list[str] = []
    # os.walk skips directories it cannot list (onerror=None) rather than raising. config-*/ holds
    # this machine's build files and _sysconfigdata* its build paths: they differ between machines.
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _LEFT_OUT_DIRS and not d.startswith("config-")]
        rel_dir = Path(dirpath).relative_to(root)
        found += [(rel_dir / f).as_posix() for f in filenames if f.endswith(".py") and not f.startswith("_sysconfigdata")]
    return sorted(found, key=lambda rel: (hashlib.sha256(rel.encode()).digest(), rel))


def build_corpus(
    root: Path, train_bytes: int = TRAIN_BYTES, held_out_bytes: int = HELD_OUT_BYTES, file_bytes: int = FILE_BYTES
) -> Corpus:
    """Reads ``root``'s source files in corpus order until both splits hold their byte budget.

    Raises:
        ValueError: a split ends up with fewer than CONTEXT + 1 bytes (not one training window).
    """
    budget = {False: train_bytes, True: held_out_bytes}
    parts: dict[bool, list[bytes]] = {False: [], True: []}
    files: dict[bool, list[str]] = {False: [], True: []}
    skipped = 0
    for rel in source_files(root):
        held = is_held_out(rel)
        if budget[held] <= 0:
            if budget[not held] <= 0:
                break
            continue
        try:
            with open(root / rel, "rb") as f:
                text = f.read(min(budget[held], file_bytes))
        except OSError as e:
            skipped += 1
            logger.warning("skipping %s: %s", root / rel, e)
            continue
        parts[held].append(text)
        files[held].append(rel)
        budget[held] -= len(text)
    train, held_out = (_as_bytes_tensor(b"".join(parts[h])) for h in (False, True))
    for name, kept in (("training", train), ("held-out", held_out)):
        if len(kept) < CONTEXT + 1:
            raise ValueError(f"{root} gave only {len(kept)} bytes of {name} text; at least {CONTEXT + 1} are needed")
    return Corpus(train, held_out, tuple(files[False]), tuple(files[True]), skipped)


def _as_bytes_tensor(data: bytes) -> torch.Tensor:
    # torch.frombuffer refuses an empty buffer; an empty split is reported by the caller instead.
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)


@functools.cache
def corpus() -> Corpus:
    """The standard library corpus of this interpreter, read once per process."""
    c = build_corpus(Path(sysconfig.get_paths()["stdlib"]))
    logger.info(
        "stdlib corpus %s: %d training bytes from %d files, %d held-out bytes from %d files, %d unreadable",
        c.digest, len(c.train), len(c.train_files), len(c.held_out), len(c.held_out_files), c.skipped,
    )
    return c


def _windows(text: torch.Tensor, idx: torch.Tensor) -> Batch:
    # Window k is bytes [k*CONTEXT, k*CONTEXT + CONTEXT] of the text: CONTEXT inputs and, shifted by
    # one, CONTEXT targets. Windows tile the text, so every byte is a target in exactly one window.
    rows = text[idx.unsqueeze(1) * CONTEXT + torch.arange(CONTEXT + 1)].long()
    return rows[:, :-1], rows[:, 1:].reshape(-1)


def num_windows(text: torch.Tensor) -> int:
    return (len(text) - 1) // CONTEXT


@dataclass(kw_only=True, frozen=True)
class LMShape:
    """The transformer's size."""

    vocab: int = VOCAB
    context: int = CONTEXT
    """Longest input the position embedding covers."""
    d_model: int = 128
    layers: int = 2
    heads: int = 4
    """Attention heads; must divide d_model."""

    def __post_init__(self) -> None:
        for name in ("vocab", "context", "d_model", "layers", "heads"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.d_model % self.heads:
            raise ValueError(f"heads must divide d_model={self.d_model}, got {self.heads}")


class _Block(nn.Module):
    """Pre-norm causal self-attention and a 4x GELU MLP, each on a residual path."""

    def __init__(self, shape: LMShape) -> None:
        super().__init__()
        self.heads = shape.heads
        self.norm1 = nn.LayerNorm(shape.d_model)
        self.qkv = nn.Linear(shape.d_model, 3 * shape.d_model)
        self.proj = nn.Linear(shape.d_model, shape.d_model)
        self.norm2 = nn.LayerNorm(shape.d_model)
        self.mlp = nn.Sequential(nn.Linear(shape.d_model, 4 * shape.d_model), nn.GELU(), nn.Linear(4 * shape.d_model, shape.d_model))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.norm2(x))


class CharTransformer(nn.Module):
    """Byte tokens (B, T) int64, T <= context -> next-byte logits flattened to (B*T, vocab)."""

    def __init__(self, shape: LMShape) -> None:
        super().__init__()
        self.shape = shape
        self.token = nn.Embedding(shape.vocab, shape.d_model)
        self.position = nn.Embedding(shape.context, shape.d_model)
        self.blocks = nn.ModuleList(_Block(shape) for _ in range(shape.layers))
        self.norm = nn.LayerNorm(shape.d_model)
        self.head = nn.Linear(shape.d_model, shape.vocab, bias=False)
        # Small embeddings and a zero head: the untrained model predicts the uniform distribution
        # (8 bits per byte), a known starting point for the "bits per char fell" check.
        for emb in (self.token, self.position):
            nn.init.normal_(emb.weight, std=0.02)
        nn.init.zeros_(self.head.weight)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        t = tokens.shape[1]
        if t > self.shape.context:
            raise ValueError(f"input has {t} tokens; this model takes at most context={self.shape.context}")
        x = self.token(tokens) + self.position(torch.arange(t, device=tokens.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x)).reshape(-1, self.shape.vocab)


def model(seed: int = MODEL_SEED) -> nn.Module:
    """The default CharTransformer: 2 layers, d_model 128, 4 heads, context 128; 478,720 parameters."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return CharTransformer(LMShape())


def data(worker_index: int, num_workers: int, seed: int = DATA_SEED, batch_size: int = BATCH_SIZE) -> ShardedStream:
    """Worker ``worker_index``'s endless, seekable stream of (bytes (B, 128) int64, next bytes (B*128,) int64)."""
    text = corpus().train

    def fetch(idx: torch.Tensor) -> Batch:
        return _windows(text, idx)

    return ShardedStream(
        num_samples=num_windows(text), worker_index=worker_index, num_workers=num_workers,
        batch_size=batch_size, seed=seed, fetch=fetch,
    )


def eval_batches(batch_size: int = EVAL_BATCH_SIZE) -> list[Batch]:
    """Every held-out window, in text order, in batches of ``batch_size`` windows."""
    text = corpus().held_out
    n = num_windows(text)
    return [_windows(text, torch.arange(i, min(i + batch_size, n))) for i in range(0, n, batch_size)]


def evaluate(model: nn.Module, batches: Iterable[Batch] | None = None) -> dict[str, float]:
    """Held-out scores: ``loss`` (mean nats per byte), ``bits_per_char`` (loss / ln 2), ``accuracy``
    (next byte right), ``chars`` (bytes scored). ``batches`` defaults to ``eval_batches()``."""
    s = score(model, eval_batches() if batches is None else batches)
    return {"loss": s.loss, "bits_per_char": s.loss / math.log(2), "accuracy": s.accuracy, "chars": s.targets}
