"""The engine core: ``LLMEngine`` (llm_engine.py), the scheduler, the KV block pool, the output processor and the
detokenizer (the sequences they share are in ``sequence.py``)."""
