"""The ``rpcps`` command as a user runs it: ``local``'s console and Ctrl-C, errors for bad flags and plug-ins, ``ctl``
against a real server, the examples end to end."""
