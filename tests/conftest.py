"""Suite-wide settings (none at present: on the CPU engines run eagerly unless a test asks for
``compilation_config={"level": 3}``, as tests/server/test_engine_compile.py does)."""
