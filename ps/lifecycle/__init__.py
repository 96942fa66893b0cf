"""Keeping the server process alive and reachable: restarts, dead peers, the store and exposure checks.

``supervisor.py`` restarts the server process (``--supervise``), ``reaper.py`` frees the slots of
workers that stopped answering, ``store_guard.py`` repairs the membership keys of the rendezvous
store, ``listener_recovery.py`` rebuilds a listener that died, and ``exposure.py`` refuses to listen
off loopback without a job secret. None of it touches parameters or gradients.
"""
