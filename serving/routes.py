"""Routes from serving: the experts vLLM's own forward chose for every token (router replay, R3).

The learner trains in FP4 and replays routing so its forward computes what the sampler
computed. Replaying the routing of its *own* high-precision forward does not do that: the
serving engine routes with its own weights and kernels, and near-ties go the other way. So
the replica records the experts vLLM chose, per MoE layer and per position, and the learner
replays those (learner/train/learn.py: `_recorded_routing`).

    RouteCapture.flywheel_capture_routes()        (inside vLLM's worker, once)
      every MoE layer's router calls back with its top-k expert ids [T, K] for the step's
      flattened tokens; after the step, `RouteBook.end_step` cuts them per request by the
      step's layout (the input batch's order, each request's scheduled token count, where
      it starts) and appends them to that request's routes
    RouteCapture.flywheel_take_routes(request_id) (after the request finished)
      the routes of positions 0..P+N-2 (every token the engine ran: the prompt and each
      completion token but the last) as int16 [L, P+N-1, K]; -1 where a position is unknown

Prefix caching: vLLM does not recompute a prompt prefix another request already ran, so the
book also keeps each full KV block's routes under a chain hash of the block's tokens (as
vLLM's block hashes chain), and fills a new request's cached prefix from it. A block it no
longer has (evicted here, or computed before capture began) stays -1; the learner routes
those positions itself. A weight swap clears the book (vLLM clears its prefix cache then too).

Where capture is impossible (a backend whose router takes no callback, a dense model) the
record carries no routes and the learner falls back to its own routing, counted in its
`recorded_routing` metric.
"""

from __future__ import annotations

import hashlib
import logging
import re
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

log = logging.getLogger(__name__)

UNKNOWN = -1
"""A position whose route the book does not know (served from a prefix cache it cannot fill)."""


@dataclass(frozen=True)
class StepRow:
    """One request's share of a step: its id, where its tokens start, how many ran, and its token
    ids up to the end of them (for the prefix blocks)."""

    request_id: str
    start: int
    count: int
    token_ids: np.ndarray


@dataclass
class _Routes:
    ids_PLK: np.ndarray  # [P, L, K] int16, grown as steps run
    known: int = 0  # positions 0..known-1 are filled (UNKNOWN where the cache could not say)
    block_keys: list[bytes] = field(default_factory=list)


class RouteBook:
    """Per-request routes built step by step, and the routes of full KV blocks by content.

    Pure bookkeeping (numpy): `add_layer` during a step's forward, `end_step` after it, `take`
    once the request finished. Bounded: at most `max_requests` unfinished-and-untaken requests
    and `max_blocks` blocks, the least recently used dropped first."""

    def __init__(self, layers: int, top_k: int, block_size: int, *, max_requests: int = 4096, max_blocks: int = 65536):
        self.layers, self.top_k, self.block_size = layers, top_k, block_size
        self.max_requests, self.max_blocks = max_requests, max_blocks
        self.requests: OrderedDict[str, _Routes] = OrderedDict()
        self.blocks: OrderedDict[bytes, np.ndarray] = OrderedDict()  # key -> [block_size, L, K]
        self._step: list[np.ndarray | None] = [None] * layers

    def add_layer(self, layer: int, ids_TK: np.ndarray) -> None:
        """Layer `layer`'s expert ids for this step's tokens, in the step's token order."""
        self._step[layer] = ids_TK

    def end_step(self, rows: list[StepRow]) -> None:
        """Cut the step's ids per request; a step some layer did not report (no MoE forward ran,
        or a layout this book cannot follow) records nothing."""
        step, self._step = self._step, [None] * self.layers
        total = sum(r.count for r in rows)
        if any(s is None or s.shape[0] < total for s in step):
            return
        ids_TLK = np.stack([s[:total] for s in step], axis=1).astype(np.int16)
        at = 0
        for r in rows:
            self._append(r, ids_TLK[at : at + r.count])
            at += r.count

    def take(self, request_id: str) -> np.ndarray | None:
        """[L, P, K] int16 of a finished request (P: the positions the engine ran), once."""
        routes = self.requests.pop(request_id, None)
        if routes is None or routes.known == 0:
            return None
        return np.ascontiguousarray(routes.ids_PLK[: routes.known].transpose(1, 0, 2))

    def clear(self) -> None:
        self.requests.clear()
        self.blocks.clear()

    # --- internals ---------------------------------------------------------------------------

    def _append(self, r: StepRow, ids_TLK: np.ndarray) -> None:
        routes = self.requests.get(r.request_id)
        if routes is None:
            routes = self._new(r)
        self.requests.move_to_end(r.request_id)
        end = r.start + r.count
        if routes.ids_PLK.shape[0] < end:
            grown = np.full((max(end, 2 * routes.ids_PLK.shape[0]), self.layers, self.top_k), UNKNOWN, np.int16)
            grown[: routes.known] = routes.ids_PLK[: routes.known]
            routes.ids_PLK = grown
        routes.ids_PLK[r.start : end] = ids_TLK
        routes.known = max(routes.known, end)
        self._keep_blocks(routes, r.token_ids, end)

    def _new(self, r: StepRow) -> _Routes:
        """A request seen for the first time: its prefix up to `r.start` came from vLLM's cache."""
        routes = _Routes(np.full((max(r.start + r.count, 16), self.layers, self.top_k), UNKNOWN, np.int16))
        bs = self.block_size
        # every block the cached prefix touches: with the whole prompt cached, vLLM still runs its
        # last token, so the prefix can end inside a block
        for b in range(min(-(-r.start // bs), len(r.token_ids) // bs)):
            key = _chain(routes.block_keys[-1] if routes.block_keys else b"", r.token_ids[b * bs : (b + 1) * bs])
            routes.block_keys.append(key)
            block = self.blocks.get(key)
            if block is not None:
                self.blocks.move_to_end(key)
                routes.ids_PLK[b * bs : (b + 1) * bs] = block
        routes.known = r.start
        self.requests[r.request_id] = routes
        while len(self.requests) > self.max_requests:
            self.requests.popitem(last=False)  # finished long ago and never taken (aborted)
        return routes

    def _keep_blocks(self, routes: _Routes, token_ids: np.ndarray, end: int) -> None:
        bs = self.block_size
        for b in range(len(routes.block_keys), end // bs):
            key = _chain(routes.block_keys[-1] if routes.block_keys else b"", token_ids[b * bs : (b + 1) * bs])
            routes.block_keys.append(key)
            block = routes.ids_PLK[b * bs : (b + 1) * bs]
            if (block == UNKNOWN).any():
                continue  # not all of it is known: another request may still supply it
            self.blocks[key] = block.copy()
            self.blocks.move_to_end(key)
        while len(self.blocks) > self.max_blocks:
            self.blocks.popitem(last=False)


def _chain(parent: bytes, tokens: np.ndarray) -> bytes:
    return hashlib.blake2b(parent + np.asarray(tokens, dtype=np.int64).tobytes(), digest_size=16).digest()


def internal_ids(request_id: str, candidates) -> list[str]:
    """vLLM's internal ids of the request the replica named `request_id`: vLLM appends 8 random
    characters (`id-1a2b3c4d`), and names the i-th of n > 1 samples `i_id-...`. First sample first."""
    pattern = re.compile(rf"^(?:(\d+)_)?{re.escape(request_id)}-[0-9a-zA-Z]{{8}}$")
    found = [(int(m.group(1) or 0), c) for c in candidates if (m := pattern.match(c))]
    return [c for _, c in sorted(found)]


# --- inside the vLLM worker ----------------------------------------------------------------------


class RouteCapture:
    """Mixed into vLLM's worker class (serving/worker.py), like the weight swap: `self` is vLLM's
    Worker. Holds a RouteBook once `flywheel_capture_routes` bound the routers."""

    def flywheel_capture_routes(self) -> dict:
        """Bind a callback to every MoE layer's router and follow each step's layout. Returns the
        layers bound (0: a dense model, or a backend without router callbacks: no capture)."""
        if getattr(self, "_flywheel_routes", None) is not None:
            return {"layers": self._flywheel_routes.layers}
        runner = self.model_runner
        routers = _moe_routers(runner.get_model())
        if not routers:
            return {"layers": 0, "why": "no MoE router with a capture callback in this model"}
        top_k = int(getattr(routers[0], "top_k", 0) or runner.model_config.get_num_experts_per_tok())
        book = RouteBook(len(routers), top_k, int(runner.cache_config.block_size))
        for i, router in enumerate(routers):
            router.set_capture_fn(lambda ids, i=i: book.add_layer(i, ids.detach().to("cpu").numpy().copy()))
        original = runner.execute_model

        def execute_model(scheduler_output, *args, **kwargs):
            out = original(scheduler_output, *args, **kwargs)
            try:
                book.end_step(_step_rows(runner, scheduler_output))
            except Exception:  # bookkeeping must never fail a step: that request just has no routes
                log.exception("route capture: could not follow this step's layout")
            return out

        runner.execute_model = execute_model
        self._flywheel_routes = book
        return {"layers": book.layers, "top_k": top_k, "block_size": book.block_size}

    def flywheel_take_routes(self, request_id: str) -> str | None:
        """The routes of the replica's request `request_id` (its first sample), in the record's
        compact form (feedback.routing), encoded here so little crosses the process boundary."""
        from feedback.routing import encode_routing

        book = getattr(self, "_flywheel_routes", None)
        if book is None:
            return None
        taken = [book.take(i) for i in internal_ids(request_id, list(book.requests))]
        return encode_routing(taken[0]) if taken and taken[0] is not None else None

    def flywheel_clear_routes(self) -> None:
        book = getattr(self, "_flywheel_routes", None)
        if book is not None:
            book.clear()


def _moe_routers(model) -> list:
    """The routers of the model's MoE layers in layer order, those that take a capture callback."""
    from vllm.model_executor.layers.fused_moe.layer import MoERunner
    from vllm.model_executor.layers.fused_moe.router.base_router import BaseRouter

    runners = [m for m in model.modules() if isinstance(m, MoERunner)]
    if not runners or not all(isinstance(m.router, BaseRouter) for m in runners):
        return []
    return [m.router for m in sorted(runners, key=lambda m: m.layer_id)]


def _step_rows(runner, scheduler_output) -> list[StepRow]:
    """The step's token layout: vLLM's runner lays out each scheduled request's tokens in its input
    batch's order, starting at the request's computed-token count (still the step's start here)."""
    batch = runner.input_batch
    rows = []
    for i, rid in enumerate(batch.req_ids):
        n = scheduler_output.num_scheduled_tokens.get(rid, 0) if rid is not None else 0
        if n:
            start = int(batch.num_computed_tokens_cpu[i])
            rows.append(StepRow(rid, start, n, batch.token_ids_cpu[i, : start + n]))
    return rows
