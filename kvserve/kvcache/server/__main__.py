"""`python -m kvserve.kvcache.server`: the same as `kvserve cache-server`."""

from __future__ import annotations

import sys

from kvserve.kvcache.server.cli import main

sys.exit(main())
