"""vLLM with the project's plugin (glm5/vllm) as the rollout engine of asynchronous RL
(glm5/train/rl/asynchronous.py).

Token in, token out: prompts go in as `prompt_token_ids`, each response comes back as token ids with the
sampled token's log-prob (`logprobs=0`, `logprobs_mode="processed_logprobs"`: after the temperature, as the
trainer's `sequence_logprobs` takes them). In the layout-invariant mode the plugin's head returns the
log-probs themselves at the engine's `temperature`, by the trainer's function in SPEC 12's arithmetic
(GLM5_LOGPROB_TEMPERATURE); vLLM samples them at temperature 1 (the same distribution) and returns their
bits (`logprobs_mode="raw_logits"`), so the ratio pi_train / pi_rollout is exactly 1 on-policy.

vLLM's V1 engine core runs in its own process (and at TP > 1 one worker process per rank); `push` sends the
whole checkpoint-named tensors to every worker through `collective_rpc` to the worker extension's
`glm5_update_weights` (glm5/train/rl/engines/vllm_worker.py, called by name with the tensors as raw bytes, so
vLLM's pickle fallback VLLM_ALLOW_INSECURE_SERIALIZATION stays off), where the plugin's `update_weights`
copies each rank's slice of the parallel plan in place (no disk reload), then resets the prefix cache (it
holds keys of the old weights).

The engine starts from a copy of the trainer's weights written as a float checkpoint into a temporary
directory (vLLM loads a model from a directory), removed by `close`.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import torch

from glm5.train.rl.engines.local import Generation, NamedTensors
from glm5.train.rl.engines.vllm_worker import RolloutWorkerExtension, named_to_wire, tensor_from_wire

WORKER_EXTENSION = f"{RolloutWorkerExtension.__module__}.{RolloutWorkerExtension.__qualname__}"


class VllmUnavailable(RuntimeError):
    """vLLM is not installed in this environment."""


def vllm_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


class VllmEngine:
    """vLLM serving the policy through the plugin at `tensor_parallel_size` ranks on this machine."""

    def __init__(
        self,
        model,
        named: NamedTensors,
        version: int = 0,
        *,
        tensor_parallel_size: int = 1,
        max_model_len: int = 256,
        max_num_seqs: int = 64,
        kv_cache_memory_bytes: int = 1 << 26,
        layout_invariant: bool = False,
        record_topk: bool = False,
        temperature: float = 1.0,
    ) -> None:
        if not vllm_installed():
            raise VllmUnavailable("vLLM is not installed (pip install the 'vllm' extra)")
        os.environ["GLM5_BACKEND"] = model.backend.name  # the plugin computes on the trainer's backend
        os.environ["GLM5_LAYOUT_INVARIANT"] = "1" if layout_invariant else "0"  # read by the plugin
        os.environ["GLM5_LOGPROB_TEMPERATURE"] = repr(float(temperature))  # the plugin's, in the mode
        self.layout_invariant, self.temperature = layout_invariant, temperature
        from vllm import LLM

        from glm5.train.rl.engines.local import PolicyEngine

        self._dir = tempfile.TemporaryDirectory(prefix="glm5-rollout-engine-")
        whole = PolicyEngine(model.config, model.backend.name, named, version)  # a whole copy to save
        whole.model.save_pretrained(Path(self._dir.name))
        whole.close()
        dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
        self.llm = LLM(
            self._dir.name,
            hf_overrides={"architectures": ["Glm5BackendsForCausalLM"]},
            skip_tokenizer_init=True,
            enforce_eager=True,
            max_model_len=max_model_len,
            # whole prompts only: vLLM-CPU fails on a seeded request whose prefill is split over steps
            # (its CPU generators cannot rewind the discarded partial-prefill sample)
            enable_chunked_prefill=False,
            max_num_batched_tokens=max(max_model_len, 256),
            max_num_seqs=max_num_seqs,
            kv_cache_memory_bytes=kv_cache_memory_bytes,
            dtype=dtype,
            seed=0,
            tensor_parallel_size=tensor_parallel_size,
            # the layout-invariant mode has no exact product for experts split on their intermediate dim:
            # they are split by expert instead (the plugin's expert parallel over the same ranks)
            enable_expert_parallel=layout_invariant and tensor_parallel_size > 1,
            distributed_executor_backend="mp" if tensor_parallel_size > 1 else None,
            logprobs_mode="raw_logits" if layout_invariant else "processed_logprobs",
            worker_extension_cls=WORKER_EXTENSION,
        )
        self.version = version
        self.pushes = 0
        # each worker's indexer top-k per request (glm5/train/rl/topk_replay.py)
        self.record_topk = record_topk
        if record_topk:
            self.llm.collective_rpc("glm5_topk_install")

    def generate(
        self, prompts: torch.Tensor, new_tokens: int, *, temperature: float, seed: int
    ) -> Generation:
        from vllm import SamplingParams

        if self.layout_invariant:  # the head's log-probs are at the engine's temperature already
            if temperature != self.temperature:
                raise ValueError(
                    f"temperature: this layout-invariant engine samples at {self.temperature} (set when it "
                    f"was built), got {temperature}"
                )
            temperature = 1.0
        rows = prompts.tolist()
        params = [
            SamplingParams(
                max_tokens=new_tokens,
                min_tokens=new_tokens,
                temperature=temperature,
                seed=seed * 1_000_003 + i,
                ignore_eos=True,
                detokenize=False,
                logprobs=0,
            )
            for i in range(len(rows))
        ]
        outs = self.llm.generate([{"prompt_token_ids": r} for r in rows], params, use_tqdm=False)
        ids, logp = [], []
        for o in outs:
            c = o.outputs[0]
            ids.append(list(c.token_ids))
            logp.append([lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids, strict=True)])
        topk = None
        if self.record_topk:
            asked = [[o.request_id, len(r), new_tokens] for o, r in zip(outs, rows, strict=True)]
            topk = tensor_from_wire(
                self.llm.collective_rpc("glm5_topk_take", args=(asked,))[0]
            )  # ranks agree
        return Generation(
            torch.tensor(ids, dtype=torch.int64), torch.tensor(logp, dtype=torch.float32), self.version, topk
        )

    def push(self, named: NamedTensors, version: int) -> None:
        self.llm.collective_rpc("glm5_update_weights", args=(named_to_wire(named),))
        self.llm.reset_prefix_cache()
        self.version = version
        self.pushes += 1

    def close(self) -> None:
        llm, self.llm = getattr(self, "llm", None), None
        if llm is not None:
            engine = getattr(llm, "llm_engine", None)
            shutdown = getattr(getattr(engine, "engine_core", None), "shutdown", None)
            if shutdown is not None:
                shutdown()
        self._dir.cleanup()
