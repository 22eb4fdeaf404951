"""The training loop on one process (docs/training.md, "What one step does").

trainer.py      TrainConfig, Trainer: the step (LM + MTP, the DSA stages' indexer KL), evaluation, metrics,
                checkpoints and bit-exact resume
options.py      the run's options, saved with every checkpoint, and the determinism they set
data.py         byte-level tokens of the Python standard library's sources, held-out split by file
losses.py       LM + MTP losses through `linear_cross_entropy`
dsa.py          indexer KL (warm-up / sparse), largest attention logit, aux-loss-free balancing (hooks)
activations.py  per-layer activation recompute / offload, applied from outside the model
state.py        atomic checkpoints (HF layout + optimizer / RNG state in safetensors + JSON)
"""
