"""Muon with Muon Split (docs/training.md, "Distributed Muon").

optimizer.py  Muon, Muon Split's per-head blocks, the Muon / AdamW parameter split
sharded.py    DistributedMuon: the same bits over FSDP2 / tensor / expert parallel shards, never gathering
              what a rank does not own
layout.py     where each rank's part of a Muon parameter lies; block categories, owners, Newton-Schulz cost
traffic.py    the analytic bytes a rank moves per step under each scheme
"""
