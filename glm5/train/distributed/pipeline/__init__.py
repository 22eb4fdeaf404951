"""Pipeline-parallel training."""
