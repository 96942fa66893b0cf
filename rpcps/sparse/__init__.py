"""What server and worker share about sparse embedding tables: id hashing, id -> bucket -> server
routing, and how a model declares its tables (``spec``). The tables themselves live in ``ps.sparse``;
the model-side module in ``worker.sparse_embedding``."""
