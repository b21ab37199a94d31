"""`flywheel learn`: user feedback in, model versions out.

    rewards ⨝ completion_choices ⨝ completions        (SQL: the sink joined Kafka's records and events)
        -> ReplayBuffer (drops samples whose behaviour version lags stable's by > max_staleness)
        -> update: FP4 QAT forward with router replay, rl_loss (PPO-clip or TIS, KL to the base), AdamW
        -> checkpoint (weights, optimizer, step, cursor, buffer: one atomic file)
        -> every `publish_every`, once `min_samples` were trained:
           gate (learner/eval.py's held-out replay vs stable, learner/train/gate.py's reward-hacking
           checks) -> pack FP4 -> learner/publish.py: store.publish (delta vs the last good
           version, STABLE last) -> model_versions -> flywheel.versions

**Input.** The sink writes a `rewards` row when a completion's feedback window closes; the
learner reads rewards joined to their completion (prompt token ids, behaviour version) and
choice (sampled token ids, behaviour logprobs, routing when the engine recorded it), in
`rewards.id` order. `rewards.id` is the learner's consumer offset. One sink writes rewards,
so ids become visible in order; with several sinks on PostgreSQL a row could commit below
an id already read and be missed (run one sink per database, as `flywheel up` does).
Samples whose outcome is not in `learn.outcomes` (by default: `unseen` and `withheld`, never
shown) are skipped and counted. An empty suggestion (just an EOS token) is a legal action, reward 0.
One editor client can post accepts for every completion it was served, so two rules keep it
from supplying a version's rewards: samples of requests that pinned their version (`model:
flywheel@vN`: the client aimed its feedback) are skipped, and each user (`user_hash`)
contributes at most `learn.max_samples_per_user` samples toward each version; the rest are
dropped and counted (`capped`). Both are in the saved state, like the cursor.

**Delivery.** The cursor, the buffer and the weights are saved together after every update,
atomically (temp file, fsync, rename). A crash loses at most the update in progress, whose
samples are read again from the saved cursor and trained once: each sample is trained
exactly once per saved state; a crash during a save keeps the previous state (the update's
samples are trained again: at-least-once). The checkpoint lists the reward ids it trained
(the last 100 000), which the crash test reads.

**Publishing.** The weights are saved before a publish, so a version always equals a saved
state. The store makes a version visible only once complete (STABLE last). If the learner
dies after that but before it recorded the version, it finds the version on restart, runs
the (deterministic) gate again on the same weights, and records and announces it then: a
version number is never published twice, and none is half-visible. A version that fails the
gate is still stored and recorded with `gate_passed = false` and the reason, so it can be
inspected, but no rollout serves it, and the learner goes back to the last good version's
weights and optimizer state before training on.

**Router replay.** Training runs the FP4 (QAT) forward with the routing of a
high-precision forward replayed in it, or the serving engine's routing when a record
carries it. Each update reports the train-vs-behaviour mismatch (KL between the learner's
and the recorded logprobs on the same tokens) with replay and without it.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import re
import shutil
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from sqlalchemy import select
from sqlalchemy.engine import Engine

from feedback import db
from feedback.core.files import open_private, private_dir
from learner.formats import ModelFormat
from learner.model import ModelArgs, Transformer, WeightHook
from learner.train.learn_settings import LearnSection, LearnSettings
from learner.train.rl_loss import RLInputs, rl_loss

log = logging.getLogger(__name__)

STATE_FILE, LAST_GOOD_FILE = "state.pt", "last_good.pt"
SHARDS_DIR = "shards"  # data-parallel checkpoints: one torch.distributed.checkpoint folder per save
KL_WINDOW = 512  # tokens per held-out window of the gate's KL to stable
AUDIT_IDS = 100_000


# --- samples -------------------------------------------------------------------------------------


@dataclass
class Sample:
    """One rewarded choice: the prompt the replica saw, the tokens it sampled, their logprobs."""

    reward_id: int
    completion_id: str
    choice_index: int
    version: int  # the behaviour policy: the model version that produced it
    prompt_ids: list[int]
    token_ids: list[int]
    behaviour: list[float]
    reward: float
    outcome: str | None
    routing: str | None = None  # the serving engine's routing trace (feedback.routing), when recorded
    user_hash: str = ""  # who gave the feedback (serving/routing.py): the per-user cap counts by it
    pinned: bool = False  # the request chose its version (model: flywheel@vN): not trained on


def in_vocabulary(s: Sample, vocab_size: int) -> bool:
    """A record of another model (a database shared with another base, a test's broker) names
    tokens this one may not have: one such sample would fail every forward it joins."""
    return all(0 <= t < vocab_size for t in s.prompt_ids) and all(0 <= t < vocab_size for t in s.token_ids)


def read_samples(engine: Engine, after_id: int, limit: int) -> tuple[list[Sample], int]:
    """Up to `limit` rewarded choices with `rewards.id > after_id`, oldest first, and the last id read."""
    r, c, ch = db.rewards, db.completions, db.completion_choices
    with engine.connect() as conn:
        ids = conn.execute(select(r.c.id).where(r.c.id > after_id).order_by(r.c.id).limit(limit)).scalars().all()
        if not ids:
            return [], after_id
        q = (
            select(
                r.c.id,
                r.c.completion_id,
                r.c.choice_index,
                r.c.model_version,
                r.c.reward,
                r.c.outcome,
                c.c.user_hash,
                c.c.pinned,
                c.c.prompt_token_ids,
                ch.c.token_ids,
                ch.c.logprobs,
                ch.c.routing,
            )
            .select_from(
                r.join(c, c.c.completion_id == r.c.completion_id).join(
                    ch, (ch.c.completion_id == r.c.completion_id) & (ch.c.choice_index == r.c.choice_index)
                )
            )
            .where(r.c.id > after_id, r.c.id <= ids[-1])
            .order_by(r.c.id)
        )
        rows = conn.execute(q).all()  # a reward without its completion (none in practice) is passed over
    samples = [
        Sample(
            row.id,
            row.completion_id,
            row.choice_index,
            row.model_version,
            list(row.prompt_token_ids),
            list(row.token_ids),
            [float(x) for x in row.logprobs],
            float(row.reward),
            row.outcome,
            row.routing,
            row.user_hash,
            bool(row.pinned),
        )
        for row in rows
    ]
    return samples, ids[-1]


class ReplayBuffer:
    """Untrained samples in arrival order, with a staleness bound in model versions."""

    def __init__(self, max_staleness: int, capacity: int):
        self.max_staleness = max_staleness
        self.capacity = capacity
        self.items: deque[Sample] = deque()
        self.dropped_stale = 0
        self.dropped_overflow = 0

    def __len__(self) -> int:
        return len(self.items)

    def add(self, samples: Sequence[Sample]) -> None:
        self.items.extend(samples)
        while len(self.items) > self.capacity:
            self.items.popleft()
            self.dropped_overflow += 1

    def drop_stale(self, current_version: int) -> int:
        """Remove samples whose behaviour version lags `current_version` by more than the bound."""
        keep = deque(s for s in self.items if current_version - s.version <= self.max_staleness)
        n = len(self.items) - len(keep)
        self.items, self.dropped_stale = keep, self.dropped_stale + n
        return n

    def take(self, n: int) -> list[Sample]:
        return [self.items.popleft() for _ in range(min(n, len(self.items)))]

    def state_dict(self) -> dict:
        return {
            "items": [asdict(s) for s in self.items],
            "dropped_stale": self.dropped_stale,
            "dropped_overflow": self.dropped_overflow,
        }

    def load_state_dict(self, d: dict) -> None:
        self.items = deque(Sample(**s) for s in d["items"])
        self.dropped_stale, self.dropped_overflow = d["dropped_stale"], d["dropped_overflow"]


# --- one update (pure given its inputs) ------------------------------------------------------------


@dataclass
class Batch:
    input_BS: torch.Tensor  # prompt + completion, minus the last token
    target_BT: torch.Tensor  # the completion tokens
    pos_BT: torch.Tensor  # where in input_BS each completion token is predicted
    mask_BT: torch.Tensor
    behaviour_BT: torch.Tensor
    reward_B: torch.Tensor
    routing: (
        list[torch.Tensor] | None
    )  # serving's routing, [B, S, K] per layer, -1 where unknown; None: no sample has it
    abstain_B: torch.Tensor  # the completion is a lone EOS token: the model declined to suggest


def make_batch(samples: Sequence[Sample], args: ModelArgs, fmt: ModelFormat) -> Batch:
    """Right-padded (with the model's pad token) tensors; prompts lose their oldest tokens if a
    sequence exceeds the window."""
    seqs, spans = [], []
    for s in samples:
        toks = s.token_ids[: args.max_seq_len - 1]
        keep = max(1, args.max_seq_len - len(toks))
        prompt = s.prompt_ids[-keep:]
        seqs.append(prompt + toks)
        spans.append((len(prompt), len(toks), len(s.prompt_ids) - len(prompt)))
    S = max(len(q) for q in seqs) - 1
    T = max(n for _, n, _ in spans)
    B = len(samples)
    input_BS = torch.full((B, S), fmt.pad_id, dtype=torch.long)
    target_BT = torch.full((B, T), fmt.pad_id, dtype=torch.long)
    pos_BT = torch.zeros((B, T), dtype=torch.long)
    mask_BT = torch.zeros((B, T))
    behaviour_BT = torch.zeros((B, T))
    for b, (q, (p, n, _cut), s) in enumerate(zip(seqs, spans, samples, strict=True)):
        input_BS[b, : len(q) - 1] = torch.tensor(q[:-1])
        target_BT[b, :n] = torch.tensor(q[p:])
        pos_BT[b, :n] = torch.arange(p - 1, p - 1 + n)
        mask_BT[b, :n] = 1.0
        behaviour_BT[b, :n] = torch.tensor(s.behaviour[:n])
    routing = _recorded_routing(samples, spans, args, S)
    abstain_B = torch.tensor([len(s.token_ids) == 1 and s.token_ids[0] in fmt.eos_ids for s in samples])
    return Batch(
        input_BS,
        target_BT,
        pos_BT,
        mask_BT,
        behaviour_BT,
        torch.tensor([s.reward for s in samples]),
        routing,
        abstain_B,
    )


def _recorded_routing(samples, spans, args: ModelArgs, S: int) -> list[torch.Tensor] | None:
    """The serving engine's routing as [B, S, K] per layer (record layout: feedback.routing's
    [L, positions, K] over prompt + completion minus the last token), -1 wherever a sample has no
    usable trace or a position is unknown: the model routes those itself. None when no sample has one."""
    from feedback.routing import decode_routing

    L, K = len(args.moe_layers), args.top_k
    out = [torch.full((len(samples), S, K), -1, dtype=torch.long) for _ in range(L)]
    found = False
    for b, (s, (p, n, cut)) in enumerate(zip(samples, spans, strict=True)):
        if not s.routing or not L:
            continue
        try:
            trace = decode_routing(s.routing)
        except ValueError:
            continue
        if trace.shape[0] != L or trace.shape[2] != K or trace.shape[1] < cut + p + n - 1:
            continue  # another model's trace, or one cut short
        part = trace[:, cut : cut + p + n - 1]
        if part.size and int(part.max()) >= args.n_experts:
            continue
        seg = torch.from_numpy(part.astype(np.int64))
        for i in range(L):
            out[i][b, : p + n - 1] = seg[i]
        found = True
    return out if found else None


def _known_share(batch: Batch) -> float:
    """Share of the completion tokens predicted from a position whose serving route is recorded."""
    if batch.routing is None:
        return 0.0
    known_BT = (batch.routing[0] >= 0).all(dim=-1).gather(1, batch.pos_BT).float()
    return float((known_BT * batch.mask_BT).sum() / batch.mask_BT.sum().clamp_min(1))


def token_logprobs(logits_BSV: torch.Tensor, batch: Batch) -> torch.Tensor:
    """The logprob of each completion token: the logits at the positions that predict them, then
    log_softmax over those alone (the prompt's positions, most of S, need none)."""
    at_BTV = logits_BSV.gather(1, batch.pos_BT.unsqueeze(-1).expand(-1, -1, logits_BSV.shape[-1]))
    return F.log_softmax(at_BTV.float(), dim=-1).gather(2, batch.target_BT.unsqueeze(-1)).squeeze(-1)


def k3_BT(a_BT: torch.Tensor, b_BT: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
    """The k3 estimator of KL(b || a) at each token, exp(d) - d - 1 with d = a - b: unbiased,
    never negative, and 0 at the tokens the mask leaves out.

    Evaluated as expm1(d) - d: for |d| near the float's rounding, as where the serving engine
    computes in float32 and reproduces the forward's logprobs to the last bits, exp(d) - 1 rounds
    to a multiple of the epsilon and the sum came out negative (-2.4e-10 per token over a version's
    completions); what rounding leaves below 0 is clamped to the true value's bound, 0."""
    d = (a_BT - b_BT) * mask_BT
    return (torch.expm1(d) - d).clamp_min(0) * mask_BT


def _k3(a_BT: torch.Tensor, b_BT: torch.Tensor, mask_BT: torch.Tensor) -> float:
    """`k3_BT`'s mean per token over the batch."""
    return float(k3_BT(a_BT, b_BT, mask_BT).sum() / mask_BT.sum().clamp_min(1))


EXPERTS = r"\.mlp\.experts\."
"""`learn.train_weights`' default for a mixture-of-experts model: its routed experts alone."""


def train_weights(model: torch.nn.Module, patterns: Sequence[str] | None) -> list[str]:
    """The patterns `learn.train_weights` means for `model`: the patterns given, or, by default
    (None), the routed experts (`EXPERTS`) of a mixture-of-experts model and every weight of a
    dense one."""
    if patterns is not None:
        return list(patterns)
    experts = re.compile(EXPERTS)
    return [EXPERTS] if any(experts.search(n) for n, _ in model.named_parameters()) else [".*"]


def train_only(model: torch.nn.Module, patterns: Sequence[str] | None) -> tuple[int, int]:
    """Let updates change only the weights whose names a pattern matches (re.search; the
    learner's `learn.train_weights`, resolved by `train_weights`), and freeze the rest: they get
    no gradient, so AdamW leaves them (and their bytes in every published delta) as the base's.
    Returns (trained, all) parameter counts; UserError when a pattern matches no weight of this
    model."""
    from feedback.core.errors import UserError

    compiled = [re.compile(p) for p in train_weights(model, patterns)]
    names = [n for n, _ in model.named_parameters()]
    unmatched = [p.pattern for p in compiled if not any(p.search(n) for n in names)]
    if unmatched:
        raise UserError(
            f"learn.train_weights: {unmatched[0]!r} matches no weight of this model (its names look like {names[len(names) // 2]!r})"
        )
    trained = total = 0
    for name, w in model.named_parameters():
        on = any(p.search(name) for p in compiled)
        w.requires_grad_(on)
        trained += w.numel() if on else 0
        total += w.numel()
    return trained, total


def rl_update(
    model: Transformer,
    ref: Transformer,
    opt: torch.optim.Optimizer,
    batch: Batch,
    *,
    hook: WeightHook | None,
    cfg: LearnSection,
    baseline: float | None = None,
    loss_scale: float = 1.0,
) -> dict[str, float]:
    """One AdamW step on `batch`: FP4 forward (with router replay unless disabled), rl_loss. A
    data-parallel rank passes the whole batch's `baseline` and scales its share's loss (data_parallel.py)."""
    x = batch.input_BS
    with torch.no_grad():
        ref_BT = token_logprobs(ref(x, fp4=hook), batch)
        own_BT = token_logprobs(model(x, fp4=hook), batch)  # FP4, routing chosen by the FP4 router itself
        routing = batch.routing
        if cfg.router_replay and (routing is None or any(bool((r < 0).any()) for r in routing)):
            _, hp_routing = model(x, return_routing=True)  # high-precision forward's routing ...
            # ... where the serving engine's is not known
            routing = hp_routing if routing is None else [torch.where(r < 0, h, r) for r, h in zip(routing, hp_routing)]
    model.train()
    logits = model(x, routing=routing if cfg.router_replay else None, fp4=hook)
    logp_BT = token_logprobs(logits, batch)
    loss, m = rl_loss(RLInputs(logp_BT, batch.behaviour_BT, ref_BT, batch.reward_B, batch.mask_BT, baseline), cfg)
    (loss * loss_scale if loss_scale != 1.0 else loss).backward()
    m["grad_norm"] = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip).item()
    opt.step()
    opt.zero_grad(set_to_none=True)
    with torch.no_grad():
        replayed = logp_BT.detach() if cfg.router_replay else None
        if replayed is None:
            _, hp_routing = model(x, return_routing=True)
            replayed = token_logprobs(model(x, routing=hp_routing, fp4=hook), batch)
    m["mismatch_kl_replay"] = _k3(replayed, batch.behaviour_BT, batch.mask_BT)
    m["mismatch_kl_no_replay"] = _k3(own_BT, batch.behaviour_BT, batch.mask_BT)
    m["recorded_routing"] = _known_share(batch)
    m["abstain_share"] = float(batch.abstain_B.float().mean())
    return m


def flat_metrics(d: dict, prefix: str = "") -> dict[str, float]:
    """`ModelVersion.metrics` is {name: number}: nested dicts become dotted names; None and text go."""
    out: dict[str, float] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out |= flat_metrics(v, f"{prefix}{k}.")
        elif isinstance(v, bool | int | float) and v == v:
            out[f"{prefix}{k}"] = float(v)
    return out


def model_from_packed(packed, args: ModelArgs) -> Transformer:
    """An fp32 Transformer holding exactly the served weights of a packed checkpoint (FP4 dequantized)."""
    from learner.store import to_hf_tensors

    with torch.device("meta"):
        m = Transformer(args)
    m.load_state_dict({k: v.float() for k, v in to_hf_tensors(packed).items()}, assign=True)
    return m.eval()


@torch.no_grad()
def policy_kl(p: Transformer, q: Transformer, windows_NS: torch.Tensor, batch_size: int = 8) -> float:
    """Mean per-token KL(p || q) of the next-token distributions on held-out windows."""
    total, n = 0.0, 0
    for i in range(0, len(windows_NS), batch_size):
        x = windows_NS[i : i + batch_size]
        lp, lq = F.log_softmax(p(x).float(), -1), F.log_softmax(q(x).float(), -1)
        total += float((lp.exp() * (lp - lq)).sum(-1).sum())
        n += x.numel()
    return total / max(n, 1)


# --- the learner's state ---------------------------------------------------------------------------


@dataclass
class LearnerState:
    step: int = 0
    cursor: int = 0  # last rewards.id read into the buffer
    version: int = 0  # latest version this learner published (or found published)
    last_good: int = 0  # latest version that passed the gate: the parent of the next one
    last_publish_at: float = 0.0  # wall clock, seconds since the epoch
    trained_since_publish: int = 0
    samples_read: int = 0
    samples_skipped: int = 0
    samples_capped: int = 0  # beyond learn.max_samples_per_user of one user for one version
    samples_trained: int = 0
    user_samples: dict[str, int] = field(default_factory=dict)  # per user_hash, since the last publish
    rewards_since_publish: list[float] = field(default_factory=list)
    mismatch_since_publish: list[list[float]] = field(default_factory=list)  # per update: replay, none, recorded share
    online_reward_history: list[float] = field(default_factory=list)  # mean training reward per version window
    last_metrics: dict = field(default_factory=dict)
    trained_ids: list[int] = field(default_factory=list)  # audit: the last AUDIT_IDS reward ids trained
    show_rows: list[list[float]] = field(default_factory=list)  # learner/show.py: features + accepted, newest last
    show_withheld: list[list[float]] = field(default_factory=list)  # features of what the show policy withheld
    show_policy: dict | None = None  # the last good version's show policy (ShowPolicy.as_dict)


def save_state(path: Path, model, opt, state: LearnerState, buffer: ReplayBuffer) -> None:
    blob = {
        "model": model.state_dict(),
        "optimizer": opt.state_dict(),
        "state": asdict(state),
        "buffer": buffer.state_dict(),
    }
    _atomic_save(blob, path)


def _atomic_save(blob: dict, path: Path) -> None:
    private_dir(path.parent)  # the learner's weights and the samples in its buffer: owner-only
    tmp = path.with_name(path.name + ".tmp")
    with open_private(tmp) as f:
        torch.save(blob, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _read_marker(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=False)


def _apply_state(blob: dict, model, opt, buffer: ReplayBuffer) -> LearnerState:
    model.load_state_dict(blob["model"])
    opt.load_state_dict(blob["optimizer"])
    buffer.load_state_dict(blob["buffer"])
    return LearnerState(**blob["state"])


# --- the loop ---------------------------------------------------------------------------------------


@dataclass
class Progress:
    """What the progress display shows (and the demo reads)."""

    version: int
    last_good: int
    step: int
    samples_read: int
    samples_trained: int
    buffered: int
    dropped_stale: int
    skipped: int
    capped: int
    trained_since_publish: int
    min_samples: int
    next_publish_in_s: float
    metrics: dict
    event: str = ""


class Learner:
    """The learner process's state and steps; `run` loops them. Construct, then `start()`."""

    def __init__(
        self,
        s: LearnSettings,
        *,
        progress: Callable[[Progress], None] = lambda p: None,
        producer=None,
        device: str | None = None,
        leader=None,
    ):
        """`device` set: this learner is rank 0 of a data-parallel group (torch.distributed is
        initialized; learner/train/learn_workers.py) and trains its share on that device, through
        the group's leader that `leader(model, args, format, fp4 format, fp4 targets, section,
        device)` makes (data_parallel.leader; passed in, so this module needs none of it)."""
        self.s, self.cfg = s, s.learn
        self.progress = progress
        self._producer = producer
        self.engine = db.make_engine(s.database_url)
        self.dir = s.learner_dir
        self.device = device
        self.leader = None  # data_parallel.Leader when data-parallel
        self._make_leader = leader
        self._checkpoints: dict[str, str] = {}  # marker file -> the shards folder it names

    # set-up ----------------------------------------------------------------------------------------
    def start(self) -> None:
        """Load the base and the saved state (or publish the base as v0 on a first start). The
        base is Flywheel's pretrained model, or with `model.base` set (or a store that holds an
        imported model) the store's imported model, which is imported first if it is not yet."""
        from learner import store as S
        from learner.train.pretrain import fp4_hook, load_training_corpus, pretrain_section

        self.store = S.settings_store(
            self.s,
            full_every=self.cfg.full_every,
            zstd_level=self.cfg.zstd_level,
            zstd_threads=self.cfg.zstd_threads,
        )
        db.upgrade(self.engine)
        imported = self.s.model.base is not None or (self.store.base() or {}).get("kind") == "imported"
        if imported:
            self._load_imported()
        else:
            self._load_pretrained()
        trained, total = train_only(self.model, self.cfg.train_weights)
        if trained < total:
            log.info(
                "training %s of %s parameters (learn.train_weights %s); the rest stay the base's",
                f"{trained:,}",
                f"{total:,}",
                train_weights(self.model, self.cfg.train_weights),
            )
        self.hook = fp4_hook(self.fmt, self.fp4_targets) if self.fmt else None
        if self.device is None:
            self.ref = copy.deepcopy(self.model).eval().requires_grad_(False)  # the reference policy: the base
            self.opt = torch.optim.AdamW(
                self.model.parameters(), lr=self.cfg.lr, betas=(0.9, 0.95), weight_decay=self.cfg.weight_decay
            )
            if (self.dir / SHARDS_DIR).is_dir():
                self._adopt_sharded_state()
        else:
            self._start_data_parallel()
        corpus = load_training_corpus(pretrain_section(self.s))
        self.heldout, self.train_files = corpus.heldout, corpus.train
        self.buffer = ReplayBuffer(self.cfg.max_staleness, self.cfg.buffer_capacity)
        self._stable_cache: tuple[int, Transformer, object] | None = None
        state_path = self.dir / STATE_FILE
        if state_path.is_file():
            self.state = self._load_state(state_path)
            log.info(
                "resumed the learner at step %d, cursor %d, v%d", self.state.step, self.state.cursor, self.state.version
            )
        else:
            v = self.start_version
            self.state = LearnerState(last_publish_at=time.time(), version=v, last_good=v)
            if imported:
                self._check_fresh_store()
            else:
                self._publish_base()
            self._save_last_good()
            self._save()
        self._recover_unrecorded()

    def _start_data_parallel(self) -> None:
        """Every rank builds its replica from the base weights (its reference too), before a saved state loads."""
        assert self._make_leader is not None, "a data-parallel learner needs its leader (learn_workers.py)"
        self.leader = self._make_leader(
            self.model, self.args, self.format, self.fmt, tuple(self.fp4_targets), self.cfg, self.device
        )
        self.model, self.ref, self.opt = self.leader.replica.model, self.leader.replica.ref, self.leader.replica.opt
        private_dir(self.dir / SHARDS_DIR)
        for marker in (STATE_FILE, LAST_GOOD_FILE):
            if (self.dir / marker).is_file():
                self._checkpoints[marker] = self._sharded_marker(marker)
        self._prune_shards()  # a save cut short by a crash left a folder no marker names

    def _sharded_marker(self, marker: str) -> str:
        """The shards folder `marker` names; a one-process learner's file (weights and optimizer in
        it) is first written out as shards, then replaced by a marker (payload first, marker last)."""
        from learner.train.shards import write_shards

        blob = _read_marker(self.dir / marker)
        if "checkpoint" in blob:
            return blob["checkpoint"]
        folder = f"{Path(marker).stem}-from-one-process-{uuid.uuid4().hex[:8]}"
        names = [n for n, _ in self.model.named_parameters()]
        write_shards(self.dir / SHARDS_DIR / folder, blob.pop("model"), blob.pop("optimizer"), names)
        _atomic_save(blob | {"checkpoint": folder, "workers": 1}, self.dir / marker)
        log.info("%s: the one-process learner's state, now shards in %s", marker, folder)
        return folder

    def _adopt_sharded_state(self) -> None:
        """One process after data-parallel workers: their markers become one-process files again
        (weights and optimizer read from the shards; each file replaced atomically)."""
        from learner.train.shards import read_shards

        for marker in (STATE_FILE, LAST_GOOD_FILE):
            path = self.dir / marker
            blob = _read_marker(path) if path.is_file() else {}
            if "checkpoint" not in blob:
                continue
            model = copy.deepcopy(self.model)
            opt = torch.optim.AdamW(
                model.parameters(), lr=self.cfg.lr, betas=(0.9, 0.95), weight_decay=self.cfg.weight_decay
            )
            read_shards(self.dir / SHARDS_DIR / blob.pop("checkpoint"), model, opt)
            blob.pop("workers", None)
            _atomic_save(blob | {"model": model.state_dict(), "optimizer": opt.state_dict()}, path)
            log.info("%s: the data-parallel learner's state, now one file", marker)
        shutil.rmtree(self.dir / SHARDS_DIR, ignore_errors=True)

    def _load_pretrained(self) -> None:
        """Flywheel's own base: the fp32 master weights of the pretraining run for [pretrain]."""
        from feedback.core.errors import UserError
        from learner import fp4
        from learner.formats import read_format
        from learner.tokenizer import load_tokenizer
        from learner.train.pretrain import find_base_model, load_master_weights

        base = find_base_model(self.s)
        if base is None:
            raise UserError("no pretrained base model for these [pretrain] settings: run `flywheel pretrain` first")
        self.base_dir = base
        self.model, self.args = load_master_weights(base)
        fmt = json.loads((base / "run.json").read_text())["settings"].get("fp4", "off")
        self.fmt = None if fmt == "off" else fmt
        self.fp4_targets = fp4.DEFAULT_FP4_TARGETS if self.fmt else ()
        self.tok = load_tokenizer(base / "hf")
        self.format = read_format(base / "hf", fim=self.s.model.fim)  # prompted as serving prompts it
        self.start_version = 0

    def _load_imported(self) -> None:
        """An imported base (learner/base.py): the store's model files and the weights of the version
        base.json says to start from (v0, or continued pretraining's result), FP4 targets
        dequantized: the fp32 master weights start exactly on what serving serves."""
        from feedback.core.errors import UserError
        from learner.base import ensure_imported
        from learner.formats import read_format
        from learner.tokenizer import load_tokenizer

        base = self.store.base()
        try:
            if self.s.model.base is not None:
                base, _ = ensure_imported(
                    self.s.model, self.store, engine=self.engine, producer=self.producer, replicas=0
                )
            folder = private_dir(self.dir / "base")
            for name, data in self.store.model_files().items():
                (folder / name).write_bytes(data)
            self.tok = load_tokenizer(folder)
            self.format = read_format(folder, fim=self.s.model.fim)
        except ValueError as e:
            raise UserError(str(e)) from None
        self.base_dir = folder
        self.args = ModelArgs.from_hf_config(json.loads((folder / "config.json").read_text()))
        self.start_version = base["start_version"]
        self.model = model_from_packed(self.store.materialize(self.start_version), self.args).train()
        self.fmt = base["fp4_format"]
        self.fp4_targets = tuple(base["fp4_targets"])

    def _check_fresh_store(self) -> None:
        """A first start on an imported base: the store may hold only what import and continued
        pretraining published (up to base.json's start version)."""
        from feedback.core.errors import UserError

        later = [v for v in self.store.versions() if v > self.start_version]
        if later:
            raise UserError(
                f"the weight store {self.store.uri()} already holds versions {later[-3:]} after the base's v{self.start_version} "
                f"but there is no learner state in {self.dir}: restore that folder, or give the learner a fresh data_dir"
            )

    def _publish_base(self) -> None:
        """Version 0: the pretrained base's packed FP4 artifact, exactly what serving loaded. A
        v0 already in the store with exactly these tensors (the learner died before its first
        save) is recorded and announced again, not published twice."""
        from feedback.core.errors import UserError
        from learner import delta as codec
        from learner import store as S
        from learner.publish import publish_version

        packed = (
            S.load_packed_artifact(self.base_dir / "fp4")
            if self.fmt
            else S.pack_checkpoint(self.model.state_dict(), "nvfp4", ())
        )
        stable = self.store.versions()
        if stable and not (
            stable == [0] and self.store.hashes(0) == codec.tensor_hashes(packed, self.store.hash_algorithm(0))
        ):
            raise UserError(
                f"the weight store {self.store.uri()} already holds versions {stable[-3:]} but there is no learner state in "
                f"{self.dir}: restore that folder, or give the learner a fresh data_dir"
            )
        if not stable:  # the files serving loads beside the weights (learner/store.py, "model/")
            self.store.write_model_files(self._pretrained_model_files())
        publish_version(
            self.store,
            None if stable else packed,  # stored already: record and announce it again
            parent=None,
            version=0,
            engine=self.engine,
            producer=self.producer,
            gate_passed=True,
            gate_reason=f"the pretrained base model ({self.base_dir.name})",
        )

    def _pretrained_model_files(self) -> dict[str, bytes]:
        from learner.store import BASE_FILE

        hf = self.base_dir / "hf"
        files = {p.name: p.read_bytes() for p in sorted(hf.iterdir()) if p.suffix == ".json"}
        base = {
            "format": "flywheel-base/1",
            "kind": "pretrained",
            "source": str(self.base_dir),
            "architecture": self.args.architecture,
            "parameters": self.model.num_params(),
            "fp4_format": self.fmt,
            "fp4_targets": list(self.fp4_targets),
            "start_version": 0,
        }
        return files | {BASE_FILE: (json.dumps(base, indent=1) + "\n").encode()}

    def _recover_unrecorded(self) -> None:
        """Versions in the store newer than the saved state that hold the saved weights: this learner
        published them, then died before its state moved on. A version with other weights is another
        publisher's (an operator's, the demo's degraded candidate, a damaged one a soak planted) and is
        left alone: adopted, it would become the parent of the next delta."""
        from learner import delta as codec
        from learner.store import StoreError

        mine: dict[str, str] = {}  # hash algorithm -> the saved weights' digest
        for v in self.store.versions():
            if v <= self.state.version:
                continue
            try:
                algorithm, theirs = self.store.hash_algorithm(v), self.store.manifest(v)["digest"]
                if algorithm not in mine:
                    mine[algorithm] = codec.checkpoint_digest(codec.tensor_hashes(self._packed(), algorithm), algorithm)
            except (StoreError, codec.DeltaError) as e:
                algorithm, theirs = None, f"unreadable: {e}"
            if algorithm is None or theirs != mine[algorithm]:
                log.info("v%d in the store is not this learner's (not its saved weights); left alone", v)
                continue
            with self.engine.connect() as conn:
                row = conn.execute(select(db.model_versions).where(db.model_versions.c.version == v)).first()
            if row is not None:
                passed, reason, metrics = row.gate_passed, row.gate_reason, row.metrics
            else:  # died between STABLE and recording it: same weights (saved before publishing), same gate
                passed, reason, metrics = self._gate(self.store.materialize(v), self.store.show_policy(v))
            log.warning(
                "v%d was published before the learner stopped; recording it now (gate %s)",
                v,
                "passed" if passed else "blocked",
            )
            self._finish_publish(None, passed, reason, metrics, version=v, show_policy=self.store.show_policy(v))

    # steps -------------------------------------------------------------------------------------------
    def poll(self) -> int:
        """Read new rewarded samples into the buffer; returns how many were added."""
        st = self.state
        samples, last = read_samples(self.engine, st.cursor, limit=max(512, 4 * self.cfg.batch_size))
        usable = [
            s
            for s in samples
            if s.outcome in self.cfg.outcomes
            and s.token_ids
            and len(s.behaviour) >= len(s.token_ids)
            and not s.pinned  # its client chose the version: feedback aimed at it, not the users' own
            and in_vocabulary(s, self.args.vocab_size)
        ]
        st.samples_skipped += len(samples) - len(usable)
        st.show_withheld = (st.show_withheld + self._policy_withheld(samples))[-self.cfg.show.window :]
        usable = self._within_user_cap(usable)
        st.samples_read += len(samples)
        st.cursor = last
        self.buffer.add(usable)
        self.buffer.drop_stale(self._staleness_reference())
        return len(usable)

    def _staleness_reference(self) -> int:
        """The version staleness counts from: what users are served by default (stable's version),
        not the learner's newest number. A rollout lags the learner by the versions it has not
        reached yet, and a blocked version serves nobody (the learner reverted to the last good
        one): counting from the newest dropped good samples for both. Without a stable version,
        the learner's base for this update (the last good version)."""
        from feedback import pools

        with self.engine.connect() as conn:
            stable = pools.current_stable(conn)
        return self.state.last_good if stable is None else min(stable, self.state.last_good)

    def _within_user_cap(self, samples: list[Sample]) -> list[Sample]:
        """The samples whose user has not yet given `learn.max_samples_per_user` toward the next
        version (the rest are counted and dropped): one client cannot supply a version's rewards."""
        st, cap = self.state, self.cfg.max_samples_per_user
        kept = []
        for s in samples:
            n = st.user_samples.get(s.user_hash, 0)
            if n < cap:
                st.user_samples[s.user_hash] = n + 1
                kept.append(s)
        st.samples_capped += len(samples) - len(kept)
        return kept

    def update(self) -> dict | None:
        """One update when a batch is buffered; saves the state (cursor, buffer, weights) after it."""
        if len(self.buffer) < self.cfg.batch_size:
            return None
        samples = self.buffer.take(self.cfg.batch_size)
        if self.leader is not None:
            m = self.leader.update(samples)
        else:
            m = rl_update(
                self.model,
                self.ref,
                self.opt,
                make_batch(samples, self.args, self.format),
                hook=self.hook,
                cfg=self.cfg,
            )
        st = self.state
        st.step += 1
        st.samples_trained += len(samples)
        st.trained_since_publish += len(samples)
        st.rewards_since_publish += [s.reward for s in samples]
        st.mismatch_since_publish.append([m["mismatch_kl_replay"], m["mismatch_kl_no_replay"], m["recorded_routing"]])
        st.trained_ids = (st.trained_ids + [s.reward_id for s in samples])[-AUDIT_IDS:]
        st.show_rows = (st.show_rows + self._show_rows(samples))[-self.cfg.show.window :]
        st.last_metrics = {k: round(v, 6) for k, v in m.items()}
        self._save()
        return m

    def _show_rows(self, samples: Sequence[Sample]) -> list[list[float]]:
        """The show policy's training rows (learner/show.py) from the samples users saw."""
        from learner import show

        if not self.cfg.show.enabled:
            return []
        return [
            [*self._show_features(s), float(show.accepted(s.outcome, s.reward))]
            for s in samples
            if s.outcome in show.SHOWN and s.behaviour and s.token_ids
        ]

    def _show_features(self, s: Sample) -> list[float]:
        """learner.show.features of a sample: its logprobs and text, and the line before its
        cursor as its prompt holds it (serving read the same line from the request)."""
        from learner import show
        from learner.fim import prefix_tail

        line = show.cursor_line(prefix_tail(self.format, self.tok, s.prompt_ids))
        return show.features(s.behaviour, self.tok.decode(s.token_ids), line)

    def _policy_withheld(self, samples: Sequence[Sample]) -> list[list[float]]:
        """Features of the suggestions a show policy withheld: recorded `withheld` although the
        confidence gate would have shown them. No outcome, but part of what the gate showed."""
        from learner.confidence import withheld

        if not self.cfg.show.enabled:
            return []
        gate = self.s.model.min_confidence
        return [
            self._show_features(s)
            for s in samples
            if s.outcome == "withheld" and s.behaviour and s.token_ids and not withheld(s.behaviour, gate)
        ]

    def _show_policy(self):
        """The show policy to publish with the next version: fitted on the newest outcomes, or
        the last good version's while there are too few (None: none yet, or `learn.show` is off)."""
        from learner import show
        from learner.show import ShowPolicy

        c = self.cfg.show
        if not c.enabled:
            return None
        # Rows kept by an older Flywheel have fewer features (no cursor context): not fitted on.
        width = len(show.FEATURES)
        rows = [r for r in self.state.show_rows if len(r) == width + 1]
        fitted = c.fit(rows, [r for r in self.state.show_withheld if len(r) == width])
        if fitted is not None:
            return fitted
        return ShowPolicy.from_dict(self.state.show_policy) if self.state.show_policy else None

    def publish_due(self, now: float | None = None) -> bool:
        st = self.state
        return (
            st.trained_since_publish >= self.cfg.min_samples
            and (now or time.time()) - st.last_publish_at >= self.cfg.publish_every
        )

    def publish(self) -> dict:
        """Gate, then store the candidate as the next version (delta against the last good one)."""
        self._save()  # the published weights are a saved state (see the module docstring)
        packed = self._packed()
        policy = self._show_policy()
        passed, reason, metrics = self._gate(packed, policy)
        return self._finish_publish(packed, passed, reason, metrics, show_policy=policy)

    def _packed(self) -> dict:
        """The model's weights as a version: packed FP4 targets, bf16 for the rest."""
        from learner import store as S

        return S.pack_checkpoint(self.model.state_dict(), self.fmt or "nvfp4", self.fp4_targets if self.fmt else ())

    def _finish_publish(
        self,
        packed,
        passed: bool,
        reason: str | None,
        metrics: dict,
        *,
        version: int | None = None,
        show_policy=None,
    ) -> dict:
        """Publish `packed` as the next version with `show_policy` (learner/show.py), a delta
        against the last good one (None: the stored `version`, recovered), then move the
        learner's state on to it."""
        from learner.publish import cleanup, publish_version

        st = self.state
        online = sum(st.rewards_since_publish) / len(st.rewards_since_publish) if st.rewards_since_publish else None
        mismatch = st.mismatch_since_publish
        metrics = {
            **metrics,
            "online_reward": online,
            "samples_trained": st.trained_since_publish,
            "learner_step": st.step,
            **(
                {"show_policy_samples": show_policy.samples, "show_policy_accepts": show_policy.accepts}
                if show_policy is not None
                else {}
            ),
            # the train-inference mismatch of this version's updates, and how much of it replayed serving's routes
            **(
                {
                    **{
                        name: sum(row[i] for row in mismatch) / len(mismatch)
                        for i, name in enumerate(("mismatch_kl_replay", "mismatch_kl_no_replay", "recorded_routing"))
                    },
                    # how many updates the means cover: a route the FP4 forward would choose
                    # differently is rare, so a few updates' mean may hold none of them
                    "mismatch_updates": len(mismatch),
                }
                if mismatch
                else {}
            ),
        }
        msg = publish_version(
            self.store,
            packed,
            parent=st.last_good,
            version=version,
            engine=self.engine,
            producer=self.producer,
            gate_passed=passed,
            gate_reason=reason,
            metrics=flat_metrics(metrics),
            show_policy=show_policy.as_dict() if show_policy is not None else None,
        )
        v = msg.version
        if online is not None:
            st.online_reward_history.append(online)
        st.version, st.last_publish_at, st.trained_since_publish, st.rewards_since_publish = v, time.time(), 0, []
        st.mismatch_since_publish = []
        st.user_samples = {}
        if passed:
            st.last_good = v
            st.show_policy = show_policy.as_dict() if show_policy is not None else None
            self._save_last_good()
        else:
            self._revert_to_last_good()
        self._save()
        cleanup(self.store, self.engine, keep=self.cfg.keep_versions, also=(st.last_good, st.version))
        return {
            "version": v,
            "parent": msg.parent,
            "kind": msg.kind,
            "size_bytes": msg.size_bytes,
            "full_size_bytes": msg.full_size_bytes,
            "gate_passed": passed,
            "gate_reason": reason,
            "metrics": metrics,
        }

    def _gate(self, packed, policy=None) -> tuple[bool, str | None, dict]:
        """Held-out replay of the candidate (with its show `policy`) against the stable version
        (with its own), then the reward-hacking checks."""
        from feedback import pools
        from learner import eval as E
        from learner.train import gate as G

        g = self.cfg.gate
        t0 = time.perf_counter()
        with self.engine.connect() as conn:
            stable_v = pools.current_stable(conn)
        if stable_v is None or stable_v not in self.store.versions():
            stable_v = self.state.last_good
        sites = E.heldout_sites(self.heldout, g.sites, seed=g.seed)
        cached = self._stable_cache if self._stable_cache is not None and self._stable_cache[0] == stable_v else None
        stable_model = cached[1] if cached else model_from_packed(self.store.materialize(stable_v), self.args)
        candidate = model_from_packed(packed, self.args)
        stable_stats, cand_stats = E.evaluate_candidate(
            candidate,
            stable_model,
            self.tok,
            self.format,
            sites,
            max_tokens=g.max_tokens,
            stable_stats=cached[2] if cached else None,
            min_confidence=self.s.model.min_confidence,
            candidate_policy=policy,
            stable_policy=self.store.show_policy(stable_v),
        )
        self._stable_cache = (stable_v, stable_model, stable_stats)
        kl = policy_kl(candidate, stable_model, self._kl_windows())
        st = self.state
        online = sum(st.rewards_since_publish) / len(st.rewards_since_publish) if st.rewards_since_publish else None
        trend = online - st.online_reward_history[-1] if online is not None and st.online_reward_history else None
        result = G.check(cand_stats, stable_stats, online_reward_trend=trend, kl=kl, thresholds=g)
        metrics = {
            **result.metrics,
            "stable_version": stable_v,
            "kl_to_stable": kl,
            "online_reward_trend": trend,
            "heldout": cand_stats.summary(),
            "stable_heldout": stable_stats.summary(),
            "gate_seconds": round(time.perf_counter() - t0, 2),
        }
        return result.passed, "; ".join(result.reasons) or None, metrics

    def _kl_windows(self) -> torch.Tensor:
        if not hasattr(self, "_windows"):
            from learner.corpus import heldout_windows, token_stream

            # An imported model's window runs to tens of thousands of tokens: the KL estimate needs far fewer.
            length = min(self.args.max_seq_len, KL_WINDOW) - 1
            self._windows = heldout_windows(token_stream(self.format, self.tok, self.heldout), length, 16)[:, :-1]
        return self._windows

    # persistence ----------------------------------------------------------------------------------------
    def _save(self) -> None:
        if self.leader is not None:
            self._save_sharded(STATE_FILE, {"state": asdict(self.state), "buffer": self.buffer.state_dict()})
            return
        save_state(self.dir / STATE_FILE, self.model, self.opt, self.state, self.buffer)

    def _save_last_good(self) -> None:
        if self.leader is not None:
            self._save_sharded(LAST_GOOD_FILE, {"version": self.state.last_good})
            return
        _atomic_save(
            {"model": self.model.state_dict(), "optimizer": self.opt.state_dict(), "version": self.state.last_good},
            self.dir / LAST_GOOD_FILE,
        )

    def _revert_to_last_good(self) -> None:
        if self.leader is not None:
            blob = _read_marker(self.dir / LAST_GOOD_FILE)
            self.leader.load(self.dir / SHARDS_DIR / blob["checkpoint"])
        else:
            blob = torch.load(self.dir / LAST_GOOD_FILE, map_location="cpu", weights_only=False)
            self.model.load_state_dict(blob["model"])
            self.opt.load_state_dict(blob["optimizer"])
        log.warning("gate blocked v%d: training goes on from v%d's weights", self.state.version, blob["version"])

    def _load_state(self, path: Path) -> LearnerState:
        """The saved state: one file with one process; with several, a marker naming its shards folder
        (either kind was converted to this learner's at start: a learner may change its worker count)."""
        blob = _read_marker(path)
        if self.leader is None:
            return _apply_state(blob, self.model, self.opt, self.buffer)
        self.leader.load(self.dir / SHARDS_DIR / blob["checkpoint"])
        self.buffer.load_state_dict(blob["buffer"])
        return LearnerState(**blob["state"])

    def _save_sharded(self, marker: str, blob: dict) -> None:
        """Every rank writes its shards into a new folder; then the marker naming that folder replaces
        the old one atomically (payloads first, the marker last), and folders no marker names go."""
        folder = f"{Path(marker).stem}-{self.state.step:08d}-{uuid.uuid4().hex[:8]}"
        self.leader.save(self.dir / SHARDS_DIR / folder)
        _atomic_save(blob | {"checkpoint": folder, "workers": self.leader.world}, self.dir / marker)
        self._checkpoints[marker] = folder
        self._prune_shards()

    def _prune_shards(self) -> None:
        keep = set(self._checkpoints.values())
        for d in (self.dir / SHARDS_DIR).iterdir():
            if d.name not in keep:
                shutil.rmtree(d, ignore_errors=True)

    @property
    def producer(self):
        """What announces versions on flywheel.versions: the one given, else a BufferedProducer
        made on first use (a learner that publishes nothing never connects to Kafka)."""
        if self._producer is None:
            from feedback.producer import BufferedProducer

            self._producer = BufferedProducer(self.s.kafka)
        return self._producer

    def close(self) -> None:
        if self._producer is not None:
            self._producer.close(timeout_s=10)

    def snapshot(self, event: str = "") -> Progress:
        st = self.state
        return Progress(
            version=st.version,
            last_good=st.last_good,
            step=st.step,
            samples_read=st.samples_read,
            samples_trained=st.samples_trained,
            buffered=len(self.buffer),
            dropped_stale=self.buffer.dropped_stale,
            skipped=st.samples_skipped,
            capped=st.samples_capped,
            trained_since_publish=st.trained_since_publish,
            min_samples=self.cfg.min_samples,
            next_publish_in_s=max(0.0, st.last_publish_at + self.cfg.publish_every - time.time()),
            metrics=st.last_metrics,
            event=event,
        )

    # the loop ------------------------------------------------------------------------------------------
    def run(self, stop: threading.Event, *, max_versions: int | None = None, until_idle: bool = False) -> None:
        """Poll, update, publish until `stop` is set, `max_versions` were published by this call,
        or (`until_idle`) nothing new arrived and less than a batch is left to train."""
        published = 0
        recovering = False
        while not stop.is_set():
            try:
                if recovering:  # a publish cut short by the outage may have stored its version already
                    self._recover_unrecorded()
                    recovering = False
                added = self.poll()
                m = self.update()
            except Exception as e:
                if not db.database_unavailable(e):
                    raise
                self._wait_for_database(e, stop)
                recovering = True
                continue
            if until_idle and not added and m is None and not self.publish_due():
                return
            if m is not None:
                self.progress(self.snapshot(f"update {self.state.step}"))
            if self.publish_due():
                try:
                    info = self.publish()
                except Exception as e:
                    if not db.database_unavailable(e):
                        raise
                    self._wait_for_database(e, stop)
                    recovering = True
                    continue
                published += 1
                verdict = "passed the gate" if info["gate_passed"] else f"BLOCKED by the gate: {info['gate_reason']}"
                self.progress(
                    self.snapshot(f"published v{info['version']} ({info['size_bytes']} B {info['kind']}), {verdict}")
                )
                if max_versions is not None and published >= max_versions:
                    return
            if m is None:
                self.progress(self.snapshot())
                stop.wait(self.cfg.poll_s)

    def _wait_for_database(self, e: Exception, stop: threading.Event) -> None:
        """An outage is waited out, not a reason to exit: the state in memory is the saved one (each
        update saves it), so trying again later loses nothing."""
        from feedback.core.errors import first_line

        log.warning(
            "database unavailable (%s); trying again in %gs", first_line(e, with_type=False), self.cfg.db_retry_s
        )
        self.progress(self.snapshot(f"database unavailable; trying again in {self.cfg.db_retry_s:g} s"))
        stop.wait(self.cfg.db_retry_s)


def describe(p: Progress) -> str:
    """One line for the progress display."""
    m = p.metrics
    train = (
        f"loss {m['loss']:.3f} reward {m['reward_mean']:+.2f} mismatch {m['mismatch_kl_replay']:.4f}/{m['mismatch_kl_no_replay']:.4f} (replay/none)"
        if m
        else "no update yet"
    )
    wait = (
        f"next publish in {p.next_publish_in_s:.0f} s"
        if p.trained_since_publish >= p.min_samples
        else f"{p.trained_since_publish}/{p.min_samples} samples for the next version"
    )
    line = (
        f"v{p.version} (last good v{p.last_good}) · step {p.step} · read {p.samples_read}, trained {p.samples_trained}, "
        f"buffer {p.buffered}, stale {p.dropped_stale}, skipped {p.skipped}, capped {p.capped} · {train} · {wait}"
    )
    return f"{p.event}: {line}" if p.event else line
