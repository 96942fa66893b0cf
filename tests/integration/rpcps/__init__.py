"""The shared layer under real processes: torch RPC group membership (rpcps/transport/) and the host's thread
budget (rpcps/threads.py)."""
