"""Reinforcement learning (docs/training.md, "The RL stage").

stage.py        the RL stage: group rollouts, a verifiable reward, IcePop updates (RLContext)
icepop.py       IcePop: pop() (beta 2), the decoupled-clip PPO loss (0.2 / 0.28), GRPO group advantages
rollout.py      the decode-path sampler (bf16 or FP8 policy), the rollout-vs-training ratio check, the
                batch-invariant mode
asynchronous.py asynchronous RL: an engine samples ahead while the trainer trains, within a staleness bound
topk_replay.py  indexer top-k record / replay between engine and trainer
engines/        the rollout engines: local.py (the interface, the project's decode path), vllm_engine.py
                (vLLM with the plugin), vllm_worker.py (its worker extension)
"""
