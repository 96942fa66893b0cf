"""The group's store as its own process (``rpcps store``) and as a 3-member etcd cluster, with servers and workers
joining and failing over through it."""
