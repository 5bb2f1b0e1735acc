"""The engine core's runner over a model in the same process: no graph generator, no
arenas. It runs each scheduled batch's forward eagerly on the model's own KV cache and
samples its tokens with the daemon's sampler (under the same allowed-token masks for
structured output), and hands a drafter that reads the target's hidden states
(`HiddenStateDrafter`, EAGLE-3) those of every row, so the in-process path (`hybridd.engine.generate`) schedules,
forks, preempts and samples exactly as the daemon does. Its steps land at once: the
core drives it one step deep, so every input token is on the host when its step is
scheduled.
"""

from __future__ import annotations

import torch

from hybridd.engine.grammar import TokenMasks
from hybridd.engine.hidden_states import feed, wanted_rows
from hybridd.engine.prompt_logprobs import compute as compute_prompt_logprobs
from hybridd.engine.sampler import Logprobs, Sampler
from hybridd.engine.scheduler import ScheduledBatch
from hybridd.engine.speculation.drafter import HiddenStateDrafter
from hybridd.engine.speculation.verification import sample_verify_rows
from hybridd.engine.step_pipeline import InflightStep
from hybridd.model.kv_cache import KVCache
from hybridd.model.llama import LlamaModel


class LandedSteps:
    """A step's logits to its landed step, for runners whose steps land at once (this
    module's, and the bench's and tests' runners over a graph runner in process): the
    prompt's logprobs, the sampled rows under their allowed-token masks, a verify step's
    rows by the rejection rule, the logprobs on the host."""

    def __init__(self, sampler: Sampler, device: torch.device) -> None:
        self.sampler = sampler
        self.device = device
        self.token_masks: TokenMasks | None = None  # made for the first constrained batch

    def sample(self, batch: ScheduledBatch, logits: torch.Tensor) -> InflightStep:
        prompt = compute_prompt_logprobs(logits, batch) if batch.prompt_rows else []
        if batch.selects_rows:
            logits = logits.index_select(0, torch.tensor(batch.sample_rows, dtype=torch.int64, device=self.device))
        seqs = batch.sampled_seqs
        tensors = batch.sampling_tensors(logits.shape[-1], self.device)
        allowed = None
        if any(seq.grammar is not None for seq in seqs):
            rows = logits.shape[0]
            if self.token_masks is None or self.token_masks.max_rows < rows:
                self.token_masks = TokenMasks(logits.shape[-1], max(rows, 64))
            masks = self.token_masks
            allowed = (masks.fill_verify(seqs, batch.drafts) if batch.is_verify else masks.fill(seqs)).to(self.device)
        with_logprobs = any(s.params.logprobs for s in seqs)
        if batch.is_verify:
            tokens, logprobs = sample_verify_rows(self.sampler, logits, tensors, seqs, batch.drafts,
                                                  batch.draft_distributions, None, with_logprobs, allowed)
        else:
            tokens, logprobs = self.sampler.sample(logits, tensors, with_logprobs=with_logprobs, allowed=allowed)
        host_logprobs = None
        if logprobs is not None:
            host_logprobs = logprobs.to(Logprobs.empty_like(logprobs, pin_memory=False))
        return InflightStep(batch, tokens.cpu(), None, host_logprobs, prompt)

    @staticmethod
    def landed(step: InflightStep) -> bool:
        return True

    @staticmethod
    def collect(step: InflightStep) -> list[int]:
        return step.host_tokens.tolist()


class InProcessRunner(LandedSteps):
    def __init__(self, model: LlamaModel, kv_cache: KVCache, sampler: Sampler | None = None,
                 hidden_drafter: HiddenStateDrafter | None = None) -> None:
        super().__init__(sampler or Sampler(compile=False), model.device)
        self.model = model
        self.hidden_drafter = hidden_drafter
        self.kv_cache = kv_cache

    @torch.inference_mode()
    def launch(self, batch: ScheduledBatch) -> InflightStep:
        if batch.inputs_on_device:
            raise RuntimeError("the in-process runner takes steps whose input tokens are on the host "
                               "(drive its core with pipeline_depth=1)")
        inputs = batch.inputs.on(self.device)
        if self.hidden_drafter is None:
            logits = self.model.forward_logits(inputs, self.kv_cache)
        else:
            hidden, aux = self.model.forward_aux(inputs, self.kv_cache, self.hidden_drafter.aux_layers)
            logits = self.model.compute_logits(hidden, inputs.logits_indices)
            # As the daemon's pipeline: only the rows the drafter keeps are handed over.
            keep = self.hidden_drafter.max_pending
            wanted = wanted_rows(batch, keep)
            feed(self.hidden_drafter, batch, aux if wanted is None else aux[wanted], keep)
        if batch.kv_copies:  # forks' copies of the prompt's last block, once this step wrote it
            self.kv_cache.copy_blocks(batch.kv_copies)
        return self.sample(batch, logits)
