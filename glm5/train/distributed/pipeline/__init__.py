"""Pipeline-parallel training (docs/training.md, "Pipeline parallel").

stages.py    where each stage's layers are: the cut, which stages a rank runs, dropping the others' modules
schedule.py  the stage modules over the model's own submodules and torch.distributed.pipelining's schedules
run.py       `--mesh pp=N`: the training loop's step, evaluation and checkpoints through the pipeline
"""
