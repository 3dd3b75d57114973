"""Suite-wide settings. On the CPU engines run eagerly unless a test asks for
``compilation_config={"level": 3}`` (tests/server/test_engine_compile.py does). Tokenizers converted from
GGUF metadata and decoded GGUF files are cached in folders of this test session (``KVFLEET_TOKENIZER_CACHE``,
``KVFLEET_GGUF_CACHE``), not the user's ~/.cache: results never depend on what an earlier run left there."""

import atexit
import os
import shutil
import tempfile

os.environ["KVFLEET_TOKENIZER_CACHE"] = tempfile.mkdtemp(prefix="kvfleet-test-tokenizers-")
atexit.register(shutil.rmtree, os.environ["KVFLEET_TOKENIZER_CACHE"], True)
os.environ["KVFLEET_GGUF_CACHE"] = tempfile.mkdtemp(prefix="kvfleet-test-gguf-")
atexit.register(shutil.rmtree, os.environ["KVFLEET_GGUF_CACHE"], True)
