"""The engine core: ``LLMEngine`` (llm_engine.py), the scheduler, sequences, the KV block pool and the detokenizer."""
