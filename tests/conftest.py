"""Suite-wide settings.

``KVFLEET_ENFORCE_EAGER=1``: engines (in-process and server subprocesses) skip torch.compile unless a
test turns compilation on (tests/server/test_engine_compile.py): the suite builds hundreds of
short-lived engines, and each compiled one spends seconds in its warm-up even with a warm cache.
"""

import os

os.environ.setdefault("KVFLEET_ENFORCE_EAGER", "1")
