"""C++ parts of the transport, compiled against the installed torch (``build.py``), never committed built."""
