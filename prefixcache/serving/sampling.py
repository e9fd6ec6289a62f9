"""Next-token choice for the batching engine, and the plain-engine fallback call."""
from __future__ import annotations

import torch
from transformers import (
    LogitsProcessorList,
    StoppingCriteriaList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)
from transformers.generation.streamers import BaseStreamer

from prefixcache.serving.scheduler import BatchRequest, SamplingParams
from prefixcache.serving.serial import CancelCriteria, Engine


def sample_next(logits: torch.Tensor, params: SamplingParams, context: list[int],
                generator: torch.Generator | None) -> int:
    """logits: [V] for one request. Greedy = argmax (as ``generate(do_sample=False)``)."""
    if params.greedy:
        return int(torch.argmax(logits))
    warpers = LogitsProcessorList([TemperatureLogitsWarper(float(params.temperature))])
    if params.top_k:
        warpers.append(TopKLogitsWarper(int(params.top_k)))
    if params.top_p is not None and params.top_p < 1.0:
        warpers.append(TopPLogitsWarper(float(params.top_p)))
    ids = torch.tensor([context], device=logits.device)  # [1, n]: processors may look at the context
    scores = warpers(ids, logits.float().unsqueeze(0))  # [1, V]
    probs = torch.softmax(scores, dim=-1)
    return int(torch.multinomial(probs[0], 1, generator=generator))


class _TokenStream(BaseStreamer):
    """Hands each generated token to a callback (skips the prompt, which generate() sends first)."""

    def __init__(self, on_token):
        self.on_token, self.prompt_seen = on_token, False

    def put(self, value: torch.Tensor) -> None:
        if not self.prompt_seen:
            self.prompt_seen = True
            return
        for t in value.reshape(-1).tolist():
            self.on_token(int(t))

    def end(self) -> None:
        pass


def fallback_generate(engine: Engine, req: BatchRequest) -> None:
    """Serve ``req`` through the one-at-a-time engine (plain ``generate()`` with prefix reuse)."""
    p = req.params
    kwargs: dict = {"max_new_tokens": p.max_new_tokens, "do_sample": not p.greedy}
    if not p.greedy:
        kwargs.update(temperature=p.temperature, top_p=p.top_p, top_k=p.top_k)
    if p.eos_token_ids:
        kwargs["eos_token_id"] = sorted(p.eos_token_ids)
    if p.seed is not None:
        kwargs["seed"] = p.seed
    if req.cancel is not None:
        kwargs["stopping_criteria"] = StoppingCriteriaList([CancelCriteria(req.cancel)])
    if req.on_token is not None:
        kwargs["streamer"] = _TokenStream(req.on_token)
    ids = torch.tensor([req.prompt], device=next(engine.model.parameters()).device)
    out, stats = engine.generate(ids, req.namespace, req.tenant, None, kwargs, req.ttl_seconds, True)
    req.stats = stats
    req.output = out[0, len(req.prompt):].tolist()
    eos = p.eos_token_ids
    if req.cancel is not None and req.cancel.is_set():
        req.finish_reason = "cancelled"
    else:
        req.finish_reason = "stop" if req.output and req.output[-1] in eos else "length"
