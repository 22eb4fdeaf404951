"""Training GLM-5 on the backend layer (docs/training.md).

data.py     byte-level tokens of the Python standard library's sources, held-out split by file
losses.py   LM + MTP losses through `linear_cross_entropy`
dsa.py      indexer KL (warm-up / sparse), largest attention logit, aux-loss-free balancing (hooks)
muon.py     Muon with Muon Split, the Muon / AdamW parameter split
state.py    atomic checkpoints (HF layout + optimizer / RNG state in safetensors + JSON)
loop.py     TrainConfig, Trainer
mesh.py     --mesh dp=N,tp=N,ep=N,pp=N parsed and checked against --nproc
distributed.py  the torchrun launcher, FSDP2 data parallel (ZeRO-2/3), the plan over tp / ep
dist_state.py   sharded checkpoints (torch.distributed.checkpoint in safetensors), export / import HF
checkpoint_cli.py  `glm5 checkpoint export-hf / import-hf`
rollout.py  the rollout sampler (decode path, bf16 or FP8 policy), rollout-vs-training ratio check,
            batch-invariant matmul mode
icepop.py   IcePop: pop() (beta 2), the decoupled-clip PPO loss (0.2 / 0.28), GRPO group advantages
rl.py       the RL stage: group rollouts, a verifiable reward, IcePop updates
plots.py    loss curves (PNG)
cli.py      `glm5 train`
"""
