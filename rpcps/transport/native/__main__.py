"""``python -m rpcps.transport.native``: builds the request filter for the installed torch (``build.main``)."""

import sys

from rpcps.transport.native.build import main

sys.exit(main())
