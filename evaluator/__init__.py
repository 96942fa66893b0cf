"""The sidecar evaluator: reads the newest model from the servers without a worker slot (the read-only
``observe`` call), scores it on held-out data, and exports the scores as Prometheus metrics.

Above ``worker`` in the layers (it reuses the worker's client and device helpers), beside it for the
command line; it never imports ``ps``.
"""
