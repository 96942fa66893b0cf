"""Hostile peers against real processes (docs/SECURITY.md): strangers on the RPC group and the store, pickle
gadgets, builtin operators, forged log lines; the peers themselves live here too."""
