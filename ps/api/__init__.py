"""The worker-facing API of the server: the RPC methods a worker calls and the rules that answer them.

``service.py`` is the RPC surface (register, pull, push, leave), ``modes.py`` turns a push into an
update by the consistency mode (async, bounded, sync), ``sync_rounds.py`` keeps the rounds of the sync
mode and ``registration_auth.py`` is the job-secret gate a worker passes before it gets a slot. It
calls into ``ps.core`` and never holds state of its own beyond rounds and issued challenges.
"""
