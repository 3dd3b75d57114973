"""Execution: the model runner (batch tensors, runs the model); tensor-parallel workers when they land."""
