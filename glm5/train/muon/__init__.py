"""Muon with Muon Split: the optimizer, and its sharded form."""
