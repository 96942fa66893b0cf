"""A built-in CTR task that needs no download: a Criteo-shaped generator and a DLRM-style model.

Select it with ``--model rpcps.examples.ctr:dlrm_model --data rpcps.examples.ctr:ctr_data --loss rpcps.examples.ctr:bce_loss``
(``ctr_data_small``: batches of 256 instead of 4096, for tests and quick runs).

**Data.** Each sample has 13 dense features (standard normal) and 26 categorical ones, one id each.
Table ``t`` draws a popularity rank from a bounded Zipf law (exponent 1.1) over a vocabulary of
``VOCAB[t]`` ranks (100 to 1 M across tables, like Criteo's spread) that grows by ``GROWTH`` of its
size every 1000 batches, so new, rarely seen ids keep appearing; the id is a 64-bit hash of
(table, rank), any int64 value. Labels come from a hidden logistic model: a fixed dense weight
vector plus one hidden scalar per (table, id), also a pure hash, so the best achievable AUC is well
above 0.5 and a model learns it only by learning per-id embeddings. Batch ``b`` of worker ``w`` is a
pure function of (w, b): seekable, reproducible, and disjoint across workers. ``eval_batches``
come from a worker index no training worker uses.

**Model.** DLRM (Naumov et al. 2019): a bottom MLP on the dense features, one 16-wide sum-pooled
sparse embedding per categorical feature (``SparseEmbeddingBagCollection``: rows on the servers),
pairwise dot products of the 27 vectors, and a top MLP on those and the bottom output.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from rpcps.model_device import model_device
from rpcps.sparse.embedding import SparseEmbeddingBagCollection
from rpcps.sparse.hashing import derive_key, keyed_hash, standard_normal
from rpcps.sparse.spec import TableSpec

DENSE = 13
TABLES = 26
DIM = 16
BATCH = 4096
SMALL_BATCH = 256
ZIPF_S = 1.1
GROWTH = 0.1
"""Share of its vocabulary each table gains every 1000 batches."""
VOCAB = tuple(int(10 ** (2 + 4 * t / (TABLES - 1))) for t in range(TABLES))
_ID_SALT, _LABEL_SALT, _DATA_SALT = 0xC7A1, 0xC7A2, 0xC7A3
_EVAL_WORKER = 1 << 20
_HIDDEN_ID_SCALE = 0.8
"""Std of the hidden per-id logit terms: with 26 of them the label depends mostly on the ids."""


@dataclass(frozen=True)
class CtrBatch:
    """A batch's model input: dense features [B, 13] and one id per categorical feature [B, 26]."""

    dense: torch.Tensor
    ids: torch.Tensor

    def to(self, device: torch.device | str, non_blocking: bool = False) -> CtrBatch:
        return CtrBatch(self.dense.to(device, non_blocking=non_blocking), self.ids.to(device, non_blocking=non_blocking))

    def __len__(self) -> int:
        return self.dense.shape[0]


def table_specs() -> tuple[TableSpec, ...]:
    return tuple(TableSpec(name=f"cat{t}", table_id=t, dim=DIM) for t in range(TABLES))


def _bounded_zipf(u: torch.Tensor, vocab: torch.Tensor) -> torch.Tensor:
    """Ranks in [0, vocab) with P(rank) ~ (rank + 1) ** -ZIPF_S (continuous inverse CDF, floored)."""
    a = 1.0 - ZIPF_S
    top = vocab.double() ** a
    ranks = ((top - 1.0) * u + 1.0) ** (1.0 / a)
    return (ranks.floor().long() - 1).clamp(min=0).minimum(vocab - 1)


def draw(worker_index: int, batch_index: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Batch ``batch_index`` of worker ``worker_index`` as (dense [B, 13], ranks [B, 26], labels [B]).

    Ranks index a fixed-size table (the one-process baseline in bench/sparse_ctr.py); the model
    sees their ids (``make_batch``)."""
    g = torch.Generator().manual_seed(derive_key(_DATA_SALT, worker_index, batch_index) & (2**63 - 1))
    dense = torch.randn(batch_size, DENSE, generator=g)
    u = torch.rand(batch_size, TABLES, generator=g, dtype=torch.float64)
    vocab = torch.tensor(VOCAB, dtype=torch.float64) * (1.0 + GROWTH * batch_index / 1000.0)
    ranks = _bounded_zipf(u, vocab.long())
    logit = dense @ _dense_weights() + _hidden_id_terms(ids_of(ranks)).sum(dim=1) - 1.0
    labels = (torch.rand(batch_size, generator=g) < torch.sigmoid(logit)).float()
    return dense, ranks, labels


def ids_of(ranks: torch.Tensor) -> torch.Tensor:
    """The 64-bit id of each rank [B, 26] (a hash of (rank, table): ids of different tables differ)."""
    return keyed_hash(ranks * TABLES + torch.arange(TABLES), _ID_SALT)


def make_batch(worker_index: int, batch_index: int, batch_size: int) -> tuple[CtrBatch, torch.Tensor]:
    """Batch ``batch_index`` of worker ``worker_index``: (inputs, float labels [B])."""
    dense, ranks, labels = draw(worker_index, batch_index, batch_size)
    return CtrBatch(dense, ids_of(ranks)), labels


def _dense_weights() -> torch.Tensor:
    g = torch.Generator().manual_seed(_LABEL_SALT)
    return torch.randn(DENSE, generator=g) * 0.3


def _hidden_id_terms(ids: torch.Tensor) -> torch.Tensor:
    return standard_normal(keyed_hash(ids, _LABEL_SALT)).float() * _HIDDEN_ID_SCALE


class CtrData:
    """One worker's endless, seekable stream of CTR batches."""

    def __init__(self, worker_index: int, batch_size: int) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.worker_index = worker_index
        self.batch_size = batch_size
        self.position = 0

    def seek(self, batch_index: int) -> None:
        self.position = batch_index

    def __iter__(self) -> Iterator[tuple[CtrBatch, torch.Tensor]]:
        while True:
            yield make_batch(self.worker_index, self.position, self.batch_size)
            self.position += 1


def ctr_data(worker_index: int, num_workers: int) -> CtrData:
    del num_workers  # batches are keyed by the worker index, so workers never share one
    return CtrData(worker_index, BATCH)


def ctr_data_small(worker_index: int, num_workers: int) -> CtrData:
    del num_workers
    return CtrData(worker_index, SMALL_BATCH)


def eval_batches(count: int = 8, batch_size: int = SMALL_BATCH, at_batch: int = 0) -> list[tuple[CtrBatch, torch.Tensor]]:
    """Held-out batches (a worker index no training worker has), drawn as of batch ``at_batch``."""
    return [make_batch(_EVAL_WORKER, at_batch + i, batch_size) for i in range(count)]


def _mlp(sizes: list[int]) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(itertools.pairwise(sizes)):
        layers.append(nn.Linear(a, b))
        if i < len(sizes) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


class DLRM(nn.Module):
    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.bottom = _mlp([DENSE, 64, DIM])
        self.embeddings = SparseEmbeddingBagCollection(table_specs(), pooling="sum")
        vectors = TABLES + 1
        self._pairs = torch.triu_indices(vectors, vectors, offset=1)
        self.top = _mlp([DIM + vectors * (vectors - 1) // 2, 64, 1])

    def forward(self, batch: CtrBatch) -> torch.Tensor:
        bottom = self.bottom(batch.dense)
        features = {f"cat{t}": (batch.ids[:, t : t + 1], None) for t in range(TABLES)}
        pooled = self.embeddings(features)
        vectors = torch.stack([bottom, *(pooled[f"cat{t}"] for t in range(TABLES))], dim=1)
        dots = torch.bmm(vectors, vectors.transpose(1, 2))[:, self._pairs[0], self._pairs[1]]
        return self.top(torch.cat([bottom, dots], dim=1)).squeeze(1)


def dlrm_model() -> nn.Module:
    return DLRM()


def bce_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.binary_cross_entropy_with_logits(logits, labels)


def auc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """Area under the ROC curve (Mann-Whitney U with tied scores sharing their mean rank)."""
    scores, labels = scores.double().flatten(), labels.flatten() > 0.5
    positives, negatives = int(labels.sum()), int((~labels).sum())
    if positives == 0 or negatives == 0:
        raise ValueError("AUC needs both positive and negative labels")
    order = scores.argsort()
    sorted_scores = scores[order]
    ranks = torch.empty_like(scores)
    ranks[order] = torch.arange(1, scores.numel() + 1, dtype=torch.float64)
    _, inverse, counts = torch.unique_consecutive(sorted_scores, return_inverse=True, return_counts=True)
    first = torch.cumsum(counts, 0) - counts + 1
    mean_rank = (first + (counts - 1) / 2.0).double()
    ranks[order] = mean_rank[inverse]
    return float((ranks[labels].sum() - positives * (positives + 1) / 2.0) / (positives * negatives))


def evaluate(model: nn.Module, batches: list[tuple[CtrBatch, torch.Tensor]]) -> dict[str, float]:
    """AUC and log loss of ``model`` (its sparse modules attached to a row source) on ``batches``,
    computed where the model is (batches are moved there); the model's mode is restored."""
    device, was_training = model_device(model), model.training
    model.eval()
    with torch.no_grad():
        scores = torch.cat([model(x.to(device)).cpu() for x, _ in batches])
    labels = torch.cat([y for _, y in batches])
    model.train(was_training)
    return {"auc": auc(scores, labels), "logloss": float(F.binary_cross_entropy_with_logits(scores, labels))}


