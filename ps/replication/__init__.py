"""Hot-standby replication of a shard: the log, the standby, failover (docs/FAULT_TOLERANCE.md)."""
