"""Training on several processes (docs/training.md, "Data parallel (FSDP2) and the mesh").

runtime.py      the torchrun launcher, `Dist`: process group, DeviceMesh, FSDP2 (ZeRO-2/3), the tp / ep plan
mesh.py         --mesh dp=N,tp=N,ep=N,pp=N parsed and checked against --nproc
checkpoint.py   sharded checkpoints (torch.distributed.checkpoint in safetensors), export / import HF
manifest.py     the manifest every loader of a sharded checkpoint verifies first
pipeline/       pipeline parallel: stages.py (the cut), schedule.py (stage modules, torch pipelining),
                run.py (the loop's step, evaluation and checkpoints through it)
"""
