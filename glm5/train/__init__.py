"""Training GLM-5 on the backend layer (docs/training.md).

cli.py             `glm5 train`
checks.py          what `glm5 train` checks before it builds or writes anything (options, run directory)
ownership.py       one owner per run: the output lock of the launcher and of each rank
checkpoint_cli.py  `glm5 checkpoint export-hf / import-hf`
plots.py           loss curves (PNG)
loop/              the training step on one process: Trainer, options, data, losses, DSA signals, activation
                   memory, checkpoints
muon/              Muon with Muon Split, 1-process and over sharded parameters
rl/                the RL stage, IcePop, rollouts, asynchronous RL and its rollout engines
distributed/       several processes: launcher and FSDP2 / plan, mesh, sharded checkpoints, pipeline
"""
