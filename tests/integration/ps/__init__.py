"""A real server's guarantees: recovery from kills and broken disks, the hot standby, resharding, durable
finish, refusals, sharding and consistency modes, the control plane, sparse tables, and chaos runs that crash it
at random."""
