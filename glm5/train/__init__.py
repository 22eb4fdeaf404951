"""Training GLM-5 on the backend layer (docs/training.md).

    data.py     byte-level tokens of the Python standard library's sources, held-out split by file
    losses.py   LM + MTP losses through `linear_cross_entropy`
    dsa.py      indexer KL (warm-up / sparse), largest attention logit, aux-loss-free balancing (hooks)
    muon.py     Muon with Muon Split, the Muon / AdamW parameter split
    state.py    atomic checkpoints (HF layout + optimizer / RNG state in safetensors + JSON)
    loop.py     TrainConfig, Trainer
    rollout.py  rollout-vs-training log-prob ratio check, batch-invariant matmul mode
    plots.py    loss curves (PNG)
    cli.py      `glm5 train`
"""
