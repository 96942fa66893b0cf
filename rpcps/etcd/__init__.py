"""The group's store in etcd (``--store etcd://HOST:PORT[,HOST:PORT...]/PREFIX``): a small v3 client
(``client``, on stubs generated from a subset of etcd's own ``.proto``), a ``torch.distributed.Store``
over it that torch RPC rendezvouses through (``store``), and keys held under etcd leases (``lease``)."""
