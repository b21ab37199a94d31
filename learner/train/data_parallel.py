"""Data-parallel training for `flywheel learn --workers N` (N > 1): the part every rank runs.

Rank 0 is the learner (learner/train/learn.py: SQL, the buffer, the gate, publishing). Every rank,
rank 0 included, holds a `Replica`: the model, the frozen reference, and its shard of the AdamW
state. Rank 0 drives the others with one broadcast command each (`Leader`); ranks 1..N-1 `follow`:

    setup(args, format)  ranks 1..N-1 build the model; DDP copies rank 0's weights to every rank
    update(samples)      rank r trains share r of the batch (`shares`); DDP averages the gradients,
                         ZeroRedundancyOptimizer steps the AdamW shard rank r owns and broadcasts
                         the parameters it updated
    save(folder)         torch.distributed.checkpoint: the model (replicated: written once) and
                         each rank's optimizer shard, keyed by parameter name
    load(folder)         the same, read back (into any number of workers: the keys are names)
    stop

**Why DDP and a sharded optimizer, not FSDP2.** FSDP2 (`fully_shard`) runs on gloo with this torch
(reduce_scatter_tensor works), but it reduce-scatters only the parameters that received a gradient
on that rank. In an MoE each rank's share of the batch routes to different experts, so the ranks'
collectives differ and gloo aborts ("Is there a distributed collective mismatch?"; checked with two
ranks and one parameter unused on one of them). Making every expert take part (adding 0 * weight)
would turn a globally unused expert's missing gradient into a zero one, which AdamW still steps (its
moments decay and move the weight), so N workers would no longer train like one. DDP with
`find_unused_parameters` leaves a globally unused parameter's gradient None, exactly as one process
does, and ZeroRedundancyOptimizer shards the optimizer state (two thirds of the training memory of
an AdamW model: the weights are replicated, the moments are not).

**Equal to one worker.** rl_loss is a token mean over the batch with the batch's mean reward as the
baseline. Each rank computes it on its share with the whole batch's baseline and scales it by
(its tokens / the batch's tokens) * N; DDP's mean over the N ranks then gives the gradient of the
whole batch's token mean, and gradient clipping sees the same full gradient on every rank.

Shapes: B samples of one share, T completion tokens (as in learn.py).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.distributed as dist

from learner.model import ModelArgs, Transformer
from learner.train.learn import Sample, make_batch, rl_update, train_only
from learner.train.learn_settings import LearnSection

# Metrics of rl_update that are means over tokens (the rest are means over samples, but these two).
TOKEN_MEANS = {
    "loss",
    "pg",
    "kl_ref",
    "mismatch_kl",
    "ratio_mean",
    "clip_frac",
    "mismatch_kl_replay",
    "mismatch_kl_no_replay",
}
SUMS, SAME_ON_EVERY_RANK = {"tokens"}, {"grad_norm"}


def shares(n: int, world: int) -> list[range]:
    """Contiguous shares of n samples over `world` ranks; sizes differ by at most one."""
    q, r = divmod(n, world)
    bounds = [0]
    for i in range(world):
        bounds.append(bounds[-1] + q + (i < r))
    return [range(a, b) for a, b in zip(bounds, bounds[1:], strict=False)]


def batch_tokens(samples: Sequence[Sample], args: ModelArgs) -> int:
    """Completion tokens make_batch masks in: each sample's tokens, cut to the window."""
    return sum(len(s.token_ids[: args.max_seq_len - 1]) for s in samples)


@dataclass(frozen=True)
class Setup:
    """What rank 0 tells the other ranks once: the architecture and how to train it."""

    args: ModelArgs
    format: object  # learner.formats.ModelFormat: the pad and EOS ids make_batch needs
    fp4: str | None  # the FP4 format of QAT, None for off
    fp4_targets: tuple[str, ...]
    cfg: LearnSection


class Replica:
    """One rank's model replica (DDP), its frozen reference, and its shard of the AdamW state."""

    def __init__(self, model: Transformer, setup: Setup, device: str):
        from torch.distributed.optim import ZeroRedundancyOptimizer
        from torch.nn.parallel import DistributedDataParallel

        from learner.train.pretrain import fp4_hook

        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.setup, self.cfg, self.args = setup, setup.cfg, setup.args
        self.device = torch.device(device)
        self.model = model.to(self.device)
        train_only(self.model, self.cfg.train_weights)  # before DDP, which syncs only the trained weights
        ids = [self.device.index] if self.device.type == "cuda" else None
        # Constructing DDP broadcasts rank 0's weights: every replica starts equal, and the reference
        # (the base: rank 0 builds its replica before it loads a saved state) is copied from them.
        self.ddp = DistributedDataParallel(self.model, device_ids=ids, find_unused_parameters=True)
        self.ref = copy.deepcopy(self.model).eval().requires_grad_(False)
        self.hook = fp4_hook(setup.fp4, setup.fp4_targets) if setup.fp4 else None
        self.opt = ZeroRedundancyOptimizer(
            self.model.parameters(),
            optimizer_class=torch.optim.AdamW,
            lr=self.cfg.lr,
            betas=(0.9, 0.95),
            weight_decay=self.cfg.weight_decay,
        )
        self.names = {p: n for n, p in self.model.named_parameters()}

    # commands ---------------------------------------------------------------------------------------
    def update(self, samples: list[Sample]) -> dict[str, float]:
        """Train this rank's share of `samples` in one step of the whole batch; the batch's metrics."""
        if any(s.routing for s in samples) and make_batch(samples, self.args, self.setup.format).routing is None:
            # One process replays recorded routing only when every sample of the batch has it.
            samples = [replace(s, routing=None) for s in samples]
        mine = [samples[i] for i in shares(len(samples), self.world)[self.rank]]
        baseline = float(torch.tensor([s.reward for s in samples]).mean())
        scale = batch_tokens(mine, self.args) / batch_tokens(samples, self.args) * self.world
        batch = _to(make_batch(mine, self.args, self.setup.format), self.device)
        m = rl_update(
            self.ddp, self.ref, self.opt, batch, hook=self.hook, cfg=self.cfg, baseline=baseline, loss_scale=scale
        )
        return self._batch_metrics(m, n_samples=len(mine))

    def _batch_metrics(self, m: dict[str, float], *, n_samples: int) -> dict[str, float]:
        """This share's metrics combined over the ranks: token means weighted by tokens, the rest by samples."""
        keys = sorted(m)
        weights = [_weight(k, m, n_samples) for k in keys]
        sums = torch.tensor([m[k] * w for k, w in zip(keys, weights, strict=True)] + weights, dtype=torch.float64)
        sums = sums.to(self.device)  # NCCL reduces only GPU tensors
        dist.all_reduce(sums)
        sums = sums.cpu()
        return {
            k: float(sums[i] / sums[len(keys) + i]) if k not in SUMS else float(sums[i]) for i, k in enumerate(keys)
        }

    def save(self, folder: Path) -> None:
        """The model and this rank's optimizer shard into `folder` (torch.distributed.checkpoint writes
        every rank's payload files, then `.metadata`)."""
        import torch.distributed.checkpoint as dcp

        dcp.save(self._state_dict(), checkpoint_id=str(folder))

    def load(self, folder: Path) -> None:
        """Weights and the AdamW state of the parameters this rank owns now (by name: any worker count saved it)."""
        import torch.distributed.checkpoint as dcp

        saved = dcp.FileSystemReader(str(folder)).read_metadata().state_dict_metadata
        owned = {self.names[p]: p for p in self._owned()}
        sd = {f"model/{k}": v for k, v in self.model.state_dict().items()}
        for key, md in saved.items():
            kind, name, _field = (key.split("/") + ["", ""])[:3]
            if kind == "optim" and name in owned:
                sd[key] = torch.empty(md.size, dtype=md.properties.dtype)
        dcp.load(sd, checkpoint_id=str(folder))  # the model's tensors in place
        state: dict[torch.nn.Parameter, dict[str, torch.Tensor]] = {}
        for key, t in sd.items():
            kind, name, field = (key.split("/") + ["", ""])[:3]
            if kind == "optim":
                p = owned[name]
                state.setdefault(p, {})[field] = t if field == "step" else t.to(p.device)
        self.opt.optim.state.clear()
        self.opt.optim.state.update(state)

    def _owned(self) -> list[torch.nn.Parameter]:
        return [p for g in self.opt.optim.param_groups for p in g["params"]]

    def _state_dict(self) -> dict[str, torch.Tensor]:
        sd = {f"model/{k}": v for k, v in self.model.state_dict().items()}
        for p, st in self.opt.optim.state.items():
            for field, v in st.items():
                sd[f"optim/{self.names[p]}/{field}"] = v
        return sd


def _weight(key: str, m: dict[str, float], n_samples: int) -> float:
    """How much one rank's value of metric `key` counts in the batch's value (divided by the weights' sum)."""
    if (
        key in SUMS or key in SAME_ON_EVERY_RANK
    ):  # a sum's weights are not divided by; equal values average to themselves
        return 1.0
    return m["tokens"] if key in TOKEN_MEANS else float(n_samples)


def _to(batch, device: torch.device):
    if device.type == "cpu":
        return batch
    moved = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in vars(batch).items()}
    if batch.routing is not None:
        moved["routing"] = [r.to(device) for r in batch.routing]
    return type(batch)(**moved)


# --- the command channel ------------------------------------------------------------------------------


def _broadcast(obj=None):
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def leader(model: Transformer, args: ModelArgs, model_format, fp4_format, fp4_targets, cfg: LearnSection, device: str):
    """Rank 0's Leader, as learn.Learner asks for it (its `leader` argument)."""
    return Leader(model, Setup(args, model_format, fp4_format, tuple(fp4_targets), cfg), device)


class Leader:
    """Rank 0's handle on the replicas: each call tells ranks 1..N-1 what to do, then does rank 0's part."""

    def __init__(self, model: Transformer, setup: Setup, device: str):
        _broadcast(("setup", setup))
        self.replica = Replica(model, setup, device)
        self.world = self.replica.world

    def update(self, samples: list[Sample]) -> dict[str, float]:
        _broadcast(("update", samples))
        return self.replica.update(samples)

    def save(self, folder: Path) -> None:
        _broadcast(("save", folder))
        self.replica.save(folder)

    def load(self, folder: Path) -> None:
        _broadcast(("load", folder))
        self.replica.load(folder)

    def stop(self) -> None:
        _broadcast(("stop", None))


def follow(device: str) -> None:
    """Ranks 1..N-1: build the replica rank 0 describes on `device`, then do what it says until it says stop."""
    command, setup = _broadcast()
    assert command == "setup", command
    with torch.device("meta"):
        model = Transformer(setup.args)
    model = model.to_empty(device=device)  # DDP overwrites every weight with rank 0's
    replica = Replica(model, setup, device)
    while True:
        command, arg = _broadcast()
        if command == "stop":
            return
        getattr(replica, command)(arg)
