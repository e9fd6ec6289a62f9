"""HTTP path: prefixcache's proxy and ``transformers serve --continuous-batching``, same client.

A closed loop of ``concurrency`` asyncio clients (httpx) streams ``/v1/completions``:
each sends its next request when its previous answer is complete. Neither server takes
token-id prompts, so a prompt goes as the text its ids decode to, drawn from tokens
whose text re-encodes to the same ids (checked per request). TTFT runs from sending the
request to the first chunk with non-empty text; the answer's ids are its streamed text
re-encoded (neither server returns ids; agreement with generate() is judged on the text,
as a byte-level BPE can re-encode the same text differently), and its token count is the server's
``usage.completion_tokens``. Greedy, ``max_tokens`` = O, EOS ignored by both: the proxy
through ``ignore_eos`` (the vLLM extension), ``transformers serve`` through a per-request
``generation_config`` (eos_token_id -1). Answers that still end early are counted in a note.
"""
from __future__ import annotations

import asyncio
import json
import math
import random
import re
import time
from dataclasses import dataclass

import httpx
import torch

from prefixcache.bench import servers
from prefixcache.bench.batch import PAGE_SIZE, BatchCall
from prefixcache.bench.options import BenchOptions
from prefixcache.bench.systems import Served
from prefixcache.bench.workloads import TokenSpace, Workload

PREFIXCACHE, TRANSFORMERS = "http-prefixcache", "http-transformers-serve"
_WORD = re.compile(r"^ [A-Za-z]+$")


@dataclass(frozen=True, slots=True)
class HttpServed(Served):
    prompt_tokens: int = 0  # as the server counted them (usage.prompt_tokens)
    completion_tokens: int = 0  # as the server counted them (usage.completion_tokens)
    text: str = ""  # the streamed answer


class HttpHarness:
    """Per dtype: the model folder and tokenizer, each server started on first use, all stopped by ``close``."""

    def __init__(self, opts: BenchOptions, model: torch.nn.Module, dtype: str):
        self.opts, self.dtype = opts, dtype
        self.folder = servers.model_folder(model, opts.model)
        self.tokenizer = self.folder.tokenizer
        self.notes: list[str] = list(self.folder.notes)
        self.blocks = 1
        self._servers: dict[str, servers.Server] = {}

    def decode(self, ids: tuple[int, ...]) -> str:
        """An answer's text as the servers stream it (special tokens skipped)."""
        return self.tokenizer.decode(list(ids), skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def text_space(self, space: TokenSpace) -> TokenSpace:
        """``space`` minus tokens whose text is not a space and letters re-encoding to themselves:
        a prompt of such tokens decodes to a text that encodes back to the same ids."""
        ids = [t for t in range(space.vocab) if t not in space.excluded]
        texts = self.tokenizer.batch_decode([[t] for t in ids], clean_up_tokenization_spaces=False)
        words = [(t, s) for t, s in zip(ids, texts, strict=True) if _WORD.match(s)]
        encoded = self.tokenizer([s for _, s in words], add_special_tokens=False)["input_ids"] if words else []
        keep = {t for (t, _), e in zip(words, encoded, strict=True) if e == [t]}
        if len(keep) < 100:
            raise servers.ServerError(f"only {len(keep)} tokens of this tokenizer round-trip as words; "
                                      "prompts cannot be sent as text")
        if len(keep) < len(ids):
            self.notes.append(f"prompts drawn from the {len(keep):,} of {len(ids):,} tokens whose text (a space "
                              "and letters) re-encodes to the same id, so every system sees the prompt the "
                              "servers get as text")
        return TokenSpace(space.vocab, frozenset(range(space.vocab)) - keep)

    def plan(self, built: list[Workload]) -> None:
        """Size transformers serve's paged pool: every request of the largest workload, unshared."""
        out = self.opts.output_tokens
        for w in built:
            history: dict[str, int] = {}
            blocks = 1
            for r in w.requests:
                history[r.session] = history.get(r.session, 0) + len(r.new_tokens)
                blocks += math.ceil((history[r.session] + out) / PAGE_SIZE)
                history[r.session] += out
            self.blocks = max(self.blocks, blocks)

    def system(self, name: str) -> HttpSystem:
        if name not in self._servers:
            self._servers[name] = self._start(name)
        return HttpSystem(name, self._servers[name], self)

    def _start(self, name: str) -> servers.Server:
        o, port = self.opts, servers.free_port()
        if name == PREFIXCACHE:
            server = servers.prefixcache_server(self.folder.path, self.dtype, port, o.concurrency, o.threads)
        else:
            server = servers.transformers_server(self.folder.path, self.dtype, port, blocks=self.blocks,
                                                 block_size=PAGE_SIZE, max_batch_tokens=o.cb_max_batch_tokens,
                                                 threads=o.threads)
        try:
            server.start(port)
            HttpSystem(name, server, self).warm_up()
        except BaseException:
            server.stop()
            raise
        return server

    def close(self) -> None:
        for server in self._servers.values():
            server.stop()
        self._servers.clear()
        self.folder.cleanup()


class HttpSystem:
    """One server as a batch-like system: ``call(prompts)`` feeds them through the client pool."""

    def __init__(self, name: str, server: servers.Server, harness: HttpHarness):
        self.name, self.server, self.harness = name, server, harness
        self.output_tokens, self.concurrency = harness.opts.output_tokens, harness.opts.concurrency
        self.ours = name == PREFIXCACHE
        self.notes: list[str] = []
        self._short = 0  # answers that stopped before max_tokens
        self._recounted = 0  # prompts the server counted differently from the client

    def start(self) -> None:
        if self.ours:  # a fresh cache per workload, as the in-process systems get
            self._check(httpx.delete(self.server.url + "/v1/cache", timeout=30))

    def finish(self) -> None:
        if self._short:
            self.notes.append(f"{self._short} answers stopped before max_tokens despite EOS being ignored")
        if self._recounted:
            self.notes.append(f"{self._recounted} prompts counted differently by the server (usage.prompt_tokens)")
        self.notes.append("peak KV = the cache's stored bytes from /v1/cache/stats after each round (in-flight KV "
                          "is not visible over HTTP)" if self.ours else
                          "peak KV n/a: transformers serve reports no KV memory; no cached_tokens in its usage, so "
                          "no hit rate; EOS ignored via generation_config eos_token_id=-1")
        if not self.server.alive():
            raise servers.ServerError(f"{self.server.name} died during the run{self.server.tail()}")

    def warm_up(self) -> None:
        """One untimed short request: first-call costs (the CB manager is built lazily) land on no request."""
        space = range(2, self.harness.tokenizer.vocab_size)
        rng = random.Random(0)
        prompt = [rng.choice(space) for _ in range(16)]
        text = self.harness.tokenizer.decode(prompt, clean_up_tokenization_spaces=False)
        try:
            asyncio.run(self._pool([(text, None)], 2))
        except (httpx.HTTPError, servers.ServerError) as exc:
            raise servers.ServerError(f"{self.name} warm-up: {exc}{self.server.tail()}") from exc

    def call(self, prompts: list[list[int]]) -> BatchCall:
        texts = [(self._text(p), p) for p in prompts]
        t0 = time.perf_counter()
        try:
            served = asyncio.run(self._pool(texts, self.output_tokens))
        except (httpx.HTTPError, servers.ServerError) as exc:
            raise servers.ServerError(f"{self.name}: {exc}{self.server.tail()}") from exc
        wall = time.perf_counter() - t0
        kv = None
        if self.ours:
            kv = int(self._check(httpx.get(self.server.url + "/v1/cache/stats", timeout=30)).json()["bytes"])
        return BatchCall(served, wall, kv)

    def _text(self, prompt: list[int]) -> str:
        tok = self.harness.tokenizer
        text = tok.decode(prompt, clean_up_tokenization_spaces=False)
        if tok(text, add_special_tokens=False)["input_ids"] != prompt:
            raise servers.ServerError(f"{self.name}: a {len(prompt)}-token prompt does not survive decode/encode, "
                                      "so it cannot be sent as text")
        return text

    async def _pool(self, texts: list[tuple[str, list[int] | None]], max_tokens: int) -> list[HttpServed]:
        served: list[HttpServed | None] = [None] * len(texts)
        queue = iter(range(len(texts)))
        limits = httpx.Limits(max_connections=self.concurrency + 1)
        async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
            async def worker() -> None:
                for i in queue:
                    served[i] = await self._one(client, texts[i][0], texts[i][1], max_tokens)

            await asyncio.gather(*(worker() for _ in range(min(self.concurrency, len(texts)))))
        return [s for s in served if s is not None]

    def _body(self, text: str, max_tokens: int) -> dict:
        body = {"model": self.harness.folder.path, "prompt": text, "max_tokens": max_tokens, "temperature": 0,
                "stream": True}
        if self.ours:
            body["stream_options"] = {"include_usage": True}  # usage.prompt_tokens_details.cached_tokens
            body["ignore_eos"] = True
        else:  # per-request GenerationConfig: greedy, EOS disabled (-1)
            body["generation_config"] = json.dumps({"max_new_tokens": max_tokens, "do_sample": False,
                                                    "eos_token_id": -1})
        return body

    async def _one(self, client: httpx.AsyncClient, text: str, prompt: list[int] | None,
                   max_tokens: int) -> HttpServed:
        first, parts, usage = None, [], None
        t0 = time.perf_counter()
        async with client.stream("POST", self.server.url + "/v1/completions", json=self._body(text, max_tokens)) as r:
            if r.status_code != 200:
                raise servers.ServerError(f"HTTP {r.status_code}: {(await r.aread())[:500]!r}")
            async for line in r.aiter_lines():
                if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                    continue
                event = json.loads(line[5:])
                if "error" in event:
                    raise servers.ServerError(f"error event mid-stream: {event['error']}")
                for choice in event.get("choices") or ():
                    if choice.get("text"):
                        first = time.perf_counter() if first is None else first
                        parts.append(choice["text"])
                usage = event.get("usage") or usage
        t1 = time.perf_counter()
        if usage is None:
            raise servers.ServerError("the stream carried no usage")
        answer = "".join(parts)
        output = tuple(self.harness.tokenizer(answer, add_special_tokens=False)["input_ids"])
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") if self.ours else None
        if prompt is not None:
            self._short += usage["completion_tokens"] < max_tokens
            self._recounted += usage["prompt_tokens"] != len(prompt)
        return HttpServed(output, (first if first is not None else t1) - t0, t1 - t0, cached,
                          usage["prompt_tokens"], usage["completion_tokens"], answer)

    @staticmethod
    def _check(resp: httpx.Response) -> httpx.Response:
        if resp.status_code >= 400:
            raise servers.ServerError(f"HTTP {resp.status_code} from {resp.request.url}: {resp.text[:500]}")
        return resp
