"""What server and worker share about sparse embedding tables: id hashing, id -> bucket -> server
routing, how a model declares its tables (``spec``), a new row's initial value (``row_init``), and
an export of the tables with its reader (``export_files``, ``serving``: inference without a server).
The tables themselves live in ``ps.sparse``; the model-side module in ``rpcps.sparse.embedding``."""
