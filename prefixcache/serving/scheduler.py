"""Which requests run, and how many tokens each feeds, in every step (no model code here).

The scheduler keeps the waiting and the running requests. Admission is cache-aware: the
longest cached prefix first, requests on one prefix together, a starved request first of
all; within the batch and private-KV budgets. A request whose next tokens another request
is prefilling right now waits for them to be stored (follow); a leader with followers
publishes its prompt early and reads the shared part in place like them (rebase); a tail
of stored runs nobody else reads is copied once into private KV (fold). ``plan_step``
splits the step's token budget: decodes first, then the prompts closest to their first token.
"""
from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Sequence

import torch

from prefixcache.cache.runs import coalesce
from prefixcache.cache.store import KVStore
from prefixcache.cache.trie import common_prefix
from prefixcache.errors import EngineFaultError, KVMemoryError
from prefixcache.model.hf_cache import private_pool
from prefixcache.model.layout import KVLayout
from prefixcache.model.private_kv import PrivateKV
from prefixcache.serving.request import Request, Status

log = logging.getLogger(__name__)

#: Tokens after its cached prefix that a waiting request must share with a running prefill
#: to wait for it instead of computing them again.
HOLD_PROBE_TOKENS = 16

#: The engine's finish path: (request, finish reason, error).
Finish = Callable[[Request, "str | None", "BaseException | None"], None]


class Scheduler:
    """Waiting and running requests, admission and step planning. Called with the engine's lock held.

    ``entropy`` seeds the generator of a sampled request that has no seed of its own.
    """

    def __init__(self, store: KVStore, layout: KVLayout, config, clock: Callable[[], float], finish: Finish,
                 entropy: Callable[[], int], beside: Callable[[], int] = lambda: 0,
                 shed: Callable[[], None] = lambda: None):
        """``beside``: bytes of KV the step runner holds besides the requests' pools (staging slabs), counted
        with them; ``shed``: free those (they give way to a request that does not fit beside them)."""
        self.store, self.layout, self.config, self._clock, self._finish = store, layout, config, clock, finish
        self._entropy = entropy
        self._beside, self._shed = beside, shed
        self.pool = private_pool(layout, config.private_chunk, plan_ahead=True)  # shared by short requests
        self.waiting: list[Request] = []
        self.running: list[Request] = []

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def remove(self, req: Request) -> None:
        for queue in (self.waiting, self.running):
            if req in queue:
                queue.remove(req)

    def schedule(self) -> list[tuple[Request, int]]:
        """Admit what fits, then plan the step: (request, new tokens) pairs."""
        self.admit()
        cfg = self.config
        return plan_step(self.running, cfg.token_budget, cfg.prefill_chunk)

    # -- admission ---------------------------------------------------------------
    def admit(self) -> None:
        """Move waiting requests into the batch, cache-aware, within the batch and memory budgets.

        Cancelled ones leave first, whatever their turn: one behind a full batch or a head waiting for
        memory would otherwise keep its caller waiting and its prefix pinned until its turn came."""
        for req in [r for r in self.waiting if r.cancelled]:
            self.waiting.remove(req)
            self._finish(req, "cancelled", None)
        cfg = self.config
        reserved = sum(r.private_need for r in self.running)
        joining: list[Request] = []  # running from now on (others' admission sees them); KV given below
        for req in admission_order(self.waiting, self._clock(), cfg.max_wait_seconds, self.running):
            if len(self.running) >= cfg.max_batch:
                break
            try:
                # Re-match first: a request sent before its prefix was stored must not wait for
                # prefills of tokens already stored since (a burst on a new system prompt would
                # otherwise admit its followers one per step, each held by the previous one's question).
                self._refresh_lease(req)
                if self._follows_a_prefill(req):
                    continue  # its prefix is being computed right now: wait for it to be stored
                req.read_steps = self._read_in_place(req)
                if self.running and reserved + req.private_need > cfg.max_private_tokens:
                    break  # keep order: the head of the queue is never overtaken for memory
                if not self._reserve([*joining, req]):
                    if self._out_of_memory(req):
                        continue
                    break  # it waits (bounded) for running requests to give KV memory back
                self.waiting.remove(req)
            except Exception as exc:  # noqa: BLE001 - fail this request only; the loop keeps serving
                self._fail_admission(req, exc)
                continue
            reserved += req.private_need
            req.status = Status.RUNNING
            self.running.append(req)
            joining.append(req)
        self._join(joining)

    def _reserve(self, joining: Sequence[Request]) -> bool:
        """Reserve the private KV of the running requests plus ``joining``; the runner's staging slabs are
        freed when the reservation fits without them only."""
        ledger, bound, beside = self.store.ledger, self.private_bound(joining), self._beside()
        if ledger.try_set("private", bound):
            return True
        if not beside or not ledger.try_set("private", bound - beside):
            return False
        self._shed()
        return True

    def _out_of_memory(self, req: Request) -> bool:
        """Fail ``req`` if its KV cannot fit the total even alone, or it waited ``kv_wait_seconds`` for it."""
        ledger, now = self.store.ledger, self._clock()
        if req.memory_wait_since is None:
            req.memory_wait_since = now
        alone = self.private_bound([req], alone=True)
        if alone <= ledger.total and now - req.memory_wait_since < ledger.wait_seconds:
            return False
        self.waiting.remove(req)
        self._finish(req, None, KVMemoryError(
            f"no room for this request's {alone} bytes of KV (prompt and answer): all KV memory may use "
            f"{ledger.total} bytes, and running requests and pinned prefixes hold it; retry"))
        return True

    def private_bound(self, joining: Sequence[Request] = (), alone: bool = False) -> int:
        """The most bytes the private KV of the running requests plus ``joining`` may take, with what the
        runner holds beside it (``alone``: of ``joining`` only, in empty pools): an upper bound of the
        pools' size as they grow.

        The shared pool holds a slot per request at the capacity of its largest need (free slots kept
        for reuse count); a pool of its own holds at most its request's need, rounded to a chunk.
        """
        chunk, bpt = self.config.private_chunk, self.layout.bytes_per_token
        members = list(joining) if alone else [*self.running, *joining]

        def shared(r: Request) -> bool:
            return r.private.pool is self.pool if r.private is not None else r.private_need <= self.config.pool_max_tokens

        short = [r for r in members if shared(r)]
        new_slots = sum(1 for r in short if r.private is None)
        live = 0 if alone else sum(1 for o in self.pool.owners if o is not None)
        slots = max(0 if alone else len(self.pool.owners), live + new_slots)
        needs = [r.private_need for r in short] + [r.private.need for r in short if r.private is not None]
        capacity = max(0 if alone else self.pool.capacity, _round(max(needs, default=0), chunk))
        own = sum(max(_round(r.private_need, chunk) * bpt, 0 if r.private is None else r.private.pool.nbytes)
                  for r in members if not shared(r))
        return slots * capacity * bpt + own + (0 if alone else self._beside())

    def _join(self, joining: list[Request]) -> None:
        """Give just admitted (running) requests their private KV; one that cannot have it fails.

        Short requests share the pool (decoded together; it grows once for all of them); a long
        one gets a pool of its own, so it does not pad every slot.
        """
        cfg = self.config
        short = [r for r in joining if r.private_need <= cfg.pool_max_tokens]
        try:
            shared = dict(zip(map(id, short), self.pool.acquire_all([r.private_need for r in short])))
        except Exception as exc:  # noqa: BLE001 - fail these requests only
            for req in short:
                self._fail_admission(req, exc)
            joining, shared = [r for r in joining if r not in short], {}
        for req in joining:
            try:
                if id(req) in shared:
                    req.private = shared[id(req)]
                else:
                    req.private = self.acquire_private(req.private_need)
                    # Its whole prompt at once: a long prefill would otherwise regrow (and copy) the
                    # pool at every chunk. The answer still grows it by chunks (max_new_tokens may be large).
                    req.private.reserve(len(req.prompt) - req.base_len)
                for snap, used in coalesce(req.copied):
                    req.private.load(snap[:, :, :, :used])
                if not req.params.greedy:  # its own generator, seeded or not: never the global RNG others draw from
                    seed = req.params.seed if req.params.seed is not None else self._entropy()
                    # On the host, where ``Sampler.next_token`` draws (a CUDA generator is refused there).
                    req.generator = torch.Generator().manual_seed(seed)
            except Exception as exc:  # noqa: BLE001 - fail this request only; the loop keeps serving
                self._fail_admission(req, exc)

    def acquire_private(self, need: int) -> PrivateKV:
        """Private KV for a request that may hold ``need`` tokens: a slot of the shared pool when they
        fit ``pool_max_tokens``, else a pool of its own (so it never pads the others' slots)."""
        if need <= self.config.pool_max_tokens:
            return self.pool.acquire(need)
        return private_pool(self.layout, self.config.private_chunk).acquire(need)

    def _fail_admission(self, req: Request, exc: Exception) -> None:
        log.exception("could not admit a request", exc_info=exc)
        self.remove(req)
        self._finish(req, None, EngineFaultError.wrapping(exc, "admitting the request"))

    def _read_in_place(self, req: Request) -> int | None:
        """How many of ``req``'s cached steps to read in place each step (None: all).

        The tail after them is copied into its private KV once: the longest run of final
        steps that no other running or waiting request holds, up to ``fold_max_tokens``,
        when that saves calls (it spans more than one stored run, or is the one run of its own
        history after a prefix others read). A whole prefix that is one run is read in place:
        nobody else may read it yet, but requests arriving next (a burst's followers) will,
        and a copy would pad every slot of the shared pool to its length while it runs.
        """
        steps = [] if req.lease is None else req.lease.steps
        others = {id(st.node) for r in (*self.running, *self.waiting) if r is not req and r.lease is not None
                  for st in r.lease.steps}
        k, tail = len(steps), 0
        while k > 0 and id(steps[k - 1].node) not in others and tail + steps[k - 1].used <= self.config.fold_max_tokens:
            k -= 1
            tail += steps[k].used
        if tail == 0:
            return None
        after_shared = k > 0 and id(steps[k - 1].node) in others
        if not after_shared and len(coalesce([(st.node.kv, st.used) for st in steps[k:]])) < 2:
            return None
        return k

    def _follows_a_prefill(self, req: Request) -> bool:
        """Whether a running request is still prefilling the tokens right after ``req``'s cached prefix.

        Computing them twice would waste the step; once that prefill ends its prompt is
        stored and ``req`` finds it (``_refresh_lease``). The leader always progresses, so
        the wait is bounded by its prefill.
        """
        start, probe = req.cached_len, HOLD_PROBE_TOKENS
        want = req.prompt[start : start + probe]
        if len(want) < probe:
            return False
        return any(a.prefilling and a.scope.namespace == req.scope.namespace and a.prompt[start : start + probe] == want
                   for a in self.running)

    def followers(self, leader: Request) -> list[Request]:
        """Waiting requests held for ``leader``'s prefill (see ``_follows_a_prefill``).

        Only for them is the prompt stored before the request finishes: storing it early
        for nobody would hold its suffix twice (stored and private) while it decodes.
        """
        probe = HOLD_PROBE_TOKENS
        return [w for w in self.waiting
                if w.scope.namespace == leader.scope.namespace and len(w.prompt) >= w.cached_len + probe
                and w.prompt[w.cached_len : w.cached_len + probe] == leader.prompt[w.cached_len : w.cached_len + probe]]

    def rebase(self, req: Request, followers: Sequence[Request]) -> None:
        """After ``req``'s prompt was stored for ``followers``: read the part they share in place.

        Its private KV then holds only the tokens after that part, in the shared pool when they
        fit, so the leader decodes in one step group with its followers instead of dragging its
        own copy of their prefix (the snapshot is a clone of the same KV: the answer is unchanged).
        Anything failing leaves the request as it was.
        """
        shared = min(common_prefix(req.prompt, w.prompt) for w in followers)
        if shared <= req.base_len:
            return
        lease = self.store.acquire(req.scope, req.prompt, shared)
        old, base = req.private, req.base_len
        if lease.cached_tokens <= base:
            self.store.release(lease)
            return
        private = None
        try:
            tail = old.window(lease.cached_tokens - base, req.held_len - base).clone()
            private = self.acquire_private(len(req.prompt) - lease.cached_tokens + req.params.max_new_tokens)
            private.load(tail)
        except Exception as exc:  # noqa: BLE001 - an optimisation: the request goes on as it was
            if private is not None:
                private.release()
            self.store.release(lease)
            log.warning("could not read a stored prompt in place: %s", exc)
            return
        self.store.release(req.lease)
        req.lease, req.read_steps, req.private = lease, None, private
        release_private(old, trim=old.pool is not self.pool)  # its own pool: freed now

    def _refresh_lease(self, req: Request) -> None:
        """Re-match at admission: prefixes stored since ``submit`` (by finished or prefilled requests) count.

        Skipped when nothing was stored since the lease was taken, or it already holds all it can."""
        held = req.lease
        if held is not None and (held.version == self.store.writes or held.cached_tokens >= len(req.prompt) - 1):
            return
        lease = self.store.acquire(req.scope, req.prompt, len(req.prompt) - 1)
        if lease.cached_tokens > req.cached_len:
            self.store.release(req.lease)
            req.lease = lease
            req.stats.cached_tokens = lease.cached_tokens
        else:
            self.store.release(lease)


def release_private(private: PrivateKV, trim: bool) -> None:
    """Free a request's private KV slot; never raises (an ``Exception`` is logged).

    Trimming reallocates the pool and can run out of memory: then the slot is freed without
    trimming, which allocates nothing. A slot that still cannot be freed stays held (logged).
    """
    for attempt in (trim, False) if trim else (False, False):
        try:
            private.release(trim=attempt)
            return
        except Exception:  # noqa: BLE001 - clean-up: the request's answer and the loop go on
            log.exception("could not free a request's private KV (trim=%s)", attempt)


def _round(tokens: int, chunk: int) -> int:
    return -(-tokens // chunk) * chunk


def admission_order(waiting: Sequence[Request], now: float, max_wait: float,
                    running: Sequence[Request] = ()) -> list[Request]:
    """Starved requests first (waited > ``max_wait``, oldest first), then longest cached
    prefix first, requests on the same prefix together, then arrival order; tenants in turn.

    In turn: within each of those two groups, a tenant's k-th request in that order ranks
    ``k`` + its ``running`` requests, and lower ranks go first. A tenant with many requests
    queued or running therefore never holds back another tenant's next one; one tenant's
    requests keep their cache-aware order among themselves.
    """
    starved = sorted((r for r in waiting if now - r.arrival > max_wait), key=lambda r: r.arrival)
    fresh = sorted((r for r in waiting if now - r.arrival <= max_wait),
                   key=lambda r: (-r.cached_len, r.group, r.arrival))
    taken = Counter(r.scope.tenant for r in running)
    return in_turn(starved, taken) + in_turn(fresh, taken)


def plan_step(active: Sequence[Request], token_budget: int, prefill_chunk: int) -> list[tuple[Request, int]]:
    """How many new tokens each request feeds this step: every decode 1, then prompt tokens
    within ``token_budget``, so a long prompt cannot stall decodes.

    The prompt budget goes to the prompts closest to their first token (fewest tokens left),
    tenants in turn (see ``in_turn``), each as much as it can take: that is the order that
    makes first tokens soonest (a burst of equal prompts finishes them one after another
    instead of all at the end together, and a short question is not held behind a long
    document), and one tenant's prompts do not hold back another's. So that a long prompt is
    never starved by a stream of shorter ones, the oldest prompt always feeds at least
    ``prefill_chunk`` tokens.
    """
    left = {id(r): r.prompt_left for r in active}  # read once: each read sums the request's stored runs
    plan = [(r, 1) for r in active if left[id(r)] <= 0]
    prefilling = sorted((r for r in active if left[id(r)] > 0), key=lambda r: r.arrival)
    budget = token_budget - len(plan)
    if not prefilling or budget <= 0:
        return plan
    oldest = prefilling[0]
    fed = {id(oldest): min(prefill_chunk, left[id(oldest)], budget)}
    budget -= fed[id(oldest)]
    for r in in_turn(sorted(prefilling, key=lambda r: (left[id(r)], r.arrival))):
        if budget <= 0:
            break
        more = min(left[id(r)] - fed.get(id(r), 0), budget)
        fed[id(r)] = fed.get(id(r), 0) + more
        budget -= more
    return plan + [(r, fed[id(r)]) for r in prefilling if fed.get(id(r), 0) > 0]


def in_turn(requests: Sequence[Request], taken: Counter[str] | None = None) -> list[Request]:
    """``requests`` with tenants taking turns: a tenant's k-th request ranks ``k`` + ``taken[tenant]``
    (requests it already has running), lower ranks first; ties, and one tenant's requests, keep their order."""
    taken = taken or Counter()
    seen: Counter[str] = Counter()
    ranked = []
    for i, r in enumerate(requests):
        ranked.append((taken[r.scope.tenant] + seen[r.scope.tenant], i, r))
        seen[r.scope.tenant] += 1
    return [r for _, _, r in sorted(ranked, key=lambda t: t[:2])]
