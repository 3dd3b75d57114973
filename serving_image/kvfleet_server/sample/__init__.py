"""Sampling: the batched sampler; rejection sampling and grammar masks when they land."""
