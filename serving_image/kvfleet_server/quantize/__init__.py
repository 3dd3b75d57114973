"""Offline quantization: ``kvfleet-quantize`` writes an FP8 checkpoint (compressed-tensors
float-quantized, the format llm-compressor writes and vLLM loads) from a float one, rounded with GPTQ
on calibration text (``gptq.py``, ``calibration.py``, ``writer.py``; the command: ``cli.py``)."""
