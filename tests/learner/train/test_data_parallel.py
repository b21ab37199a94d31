"""Data-parallel updates (learner/train/data_parallel.py) train like one process: the same
parameters after a few steps with 1 and with 2 ranks, and a checkpoint of 2 ranks resumes on 1."""

from __future__ import annotations

import copy
import dataclasses
import io
import re

import pytest
import torch
import torch.multiprocessing as mp
from rich.console import Console

from learner.model import Transformer
from learner.train.data_parallel import Setup, shares
from learner.train.learn import (
    LAST_GOOD_FILE,
    SHARDS_DIR,
    STATE_FILE,
    Learner,
    make_batch,
    model_from_packed,
    rl_update,
)
from learner.train.pretrain import ensure_base_model, fp4_hook
from learner.train.shards import read_shards, write_shards
from tests.helpers import free_port
from tests.learner.train.learn_support import (
    ListProducer,
    make_corpus,
    tiny_learn_settings,
    train_ranks,
    write_samples,
)

STEPS, BATCH = 3, 6
LR = 1e-4  # large enough that the weights move visibly in STEPS steps


def test_shares_split_a_batch_in_order_and_evenly():
    assert shares(7, 3) == [range(0, 3), range(3, 5), range(5, 7)]
    assert shares(4, 4) == [range(i, i + 1) for i in range(4)]
    assert [i for r in shares(16, 3) for i in r] == list(range(16))


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """A tiny base, STEPS batches of rewarded samples it served, and its learner's settings."""
    root = tmp_path_factory.mktemp("dp")
    corpus, cache = make_corpus(root / "corpus"), root / "cache"
    # every weight trains, so every tensor's two runs are compared (the default trains the experts)
    s = tiny_learn_settings(root, corpus, cache, batch_size=BATCH, lr=LR, max_staleness=1000, train_weights=[".*"])
    ensure_base_model(s, Console(file=io.StringIO()))
    lr = Learner(s, producer=ListProducer())
    lr.start()
    import textwrap

    src = open(textwrap.__file__).read()
    write_samples(
        lr.engine,
        model_from_packed(lr.store.materialize(0), lr.args),
        lr.tok,
        [src[i * 53 : i * 53 + 240] for i in range(STEPS * BATCH)],
    )
    lr.poll()
    batches = [lr.buffer.take(BATCH) for _ in range(STEPS)]
    assert all(len(b) == BATCH for b in batches)
    setup = Setup(lr.args, lr.format, lr.fmt, tuple(lr.fp4_targets), lr.cfg)
    return {"weights": copy.deepcopy(lr.model.state_dict()), "setup": setup, "batches": batches, "settings": s}


def one_process(job: dict, batches, *, start=None, then=None) -> tuple[dict, list[dict]]:
    """What `flywheel learn` with one worker does: rl_update with AdamW on the whole batch.
    `start(model, opt)` runs before the batches, `then(model, opt)` after them."""
    setup = job["setup"]
    model = fresh_model(job)
    ref = copy.deepcopy(model).eval().requires_grad_(False)
    assert setup.cfg.weight_decay == 0  # assert_same_training's bound counts none
    opt = torch.optim.AdamW(model.parameters(), lr=setup.cfg.lr, betas=BETAS, weight_decay=setup.cfg.weight_decay)
    if start is not None:
        start(model, opt)
    hook = fp4_hook(setup.fp4, setup.fp4_targets) if setup.fp4 else None
    metrics = [
        rl_update(model, ref, opt, make_batch(b, setup.args, setup.format), hook=hook, cfg=setup.cfg) for b in batches
    ]
    if then is not None:
        then(model, opt)
    return model.state_dict(), metrics


def fresh_model(job: dict):
    m = Transformer(job["setup"].args)
    m.load_state_dict(job["weights"])
    return m


def ranks(tmp_path, job: dict, world: int, **extra) -> dict:
    spec = tmp_path / f"job-{world}.pt"
    out = tmp_path / f"out-{world}.pt"
    torch.save(job | extra | {"out": out}, spec)
    mp.spawn(train_ranks, args=(world, free_port(), spec), nprocs=world)
    return torch.load(out, weights_only=False)


BETAS = (0.9, 0.95)  # the learner's AdamW (learner/train/learn.py)
REL_DIFF = 1e-3
"""Largest difference between two runs' weights, per tensor, as a share of how far the tensor trained
(L2 norms). Both runs do the same float32 arithmetic but for the order of some sums (the loss over
the ranks' shares, DDP's mean), so the gradients differ by rounding: relatively 1e-7 where their
terms do not cancel. AdamW divides each weight's gradient by its own running scale, so where the
terms of a gradient cancel (a rare token's output row), rounding can move that weight by a visibly
different share of lr; such weights are few, and over a tensor the runs differ by 1e-6 to 5e-5 of
the distance trained (measured: two ranks 1.5e-6 to 1.9e-5 against one process, and reordering one
process's samples 1.3e-6 to 4.6e-5). A data-parallel bug is of the order of the training itself: a rank that skips the sync trains
on half the batch, a share weighted by its own token count tilts every update (AdamW is blind to a
constant factor, so a sum in place of a mean cannot show here; `shares` and the metrics check that).
1e-3 sits 20x above the rounding and 100x or more below such a bug."""


def adam_reach(lr: float, steps: int, betas: tuple[float, float] = BETAS) -> float:
    """The most AdamW can move one weight in `steps` steps, whatever its gradients, not counting weight
    decay: lr * |m_hat / sqrt(v_hat)| per step, where |m_t| <= (1 - b1) sum_i b1^(t-i) |g_i| and
    v_t >= (1 - b2) b2^(t-i) g_i^2 for each i (1, 1.41 and 1.73 in steps 1 to 3 at (0.9, 0.95))."""
    b1, b2 = betas
    total = 0.0
    for t in range(1, steps + 1):
        reach = sum((b1 / b2**0.5) ** k for k in range(t)) * (1 - b1) / (1 - b2) ** 0.5
        total += lr * reach * ((1 - b2**t) ** 0.5 / (1 - b1**t))
    return total


def assert_same_training(got: dict, want: dict, start: dict, reordered: dict | None = None) -> None:
    """`got` trained like `want` from `start`: every tensor within REL_DIFF of the distance it trained,
    and no weight further from `want` than two AdamW runs can drift apart (`adam_reach` on each side;
    the learner's weight decay, 0 by default and here, adds nothing). `reordered`: one process trained
    on the same batches with their samples in another order, which differs by rounding alone and
    must pass the same check."""
    reach = 2 * adam_reach(LR, STEPS)
    for k in want:
        diff, moved = float((got[k] - want[k]).norm()), float((want[k] - start[k]).norm())
        assert diff <= REL_DIFF * moved, (k, diff / moved if moved else diff)
        assert float((got[k] - want[k]).abs().max()) <= reach, k
    if reordered is not None:  # rounding alone (one process, samples reordered) passes the same check
        worst = max(float((reordered[k] - want[k]).norm() / (want[k] - start[k]).norm()) for k in want)
        assert worst <= REL_DIFF, worst


def test_two_ranks_train_like_one_process(tmp_path, job):
    want, want_metrics = one_process(job, job["batches"])
    reordered, _ = one_process(job, [list(reversed(b)) for b in job["batches"]])
    got = ranks(tmp_path, job, 2)
    assert_same_training(got["weights"], want, job["weights"], reordered)
    for a, b in zip(got["metrics"], want_metrics, strict=True):  # the batch's metrics, not rank 0's share's
        assert a.keys() == b.keys() and a["tokens"] == b["tokens"]
        assert a == pytest.approx(b, rel=1e-4, abs=1e-6)


def test_two_ranks_train_only_the_weights_train_weights_names(tmp_path, job):
    experts = r"mlp\.experts\."
    setup = job["setup"]
    only = job | {"setup": dataclasses.replace(setup, cfg=setup.cfg.model_copy(update={"train_weights": [experts]}))}
    got = ranks(tmp_path, only, 2)["weights"]
    moved = {k for k in got if not torch.equal(got[k], job["weights"][k])}
    assert moved and all(re.search(experts, k) for k in moved), sorted(moved)


def test_a_two_rank_checkpoint_resumes_on_one_rank(tmp_path, job):
    """Optimizer shards are saved by parameter name: one rank loads what two saved and trains on alike."""
    folder = tmp_path / "shards" / "state-2"
    both = ranks(tmp_path, job, 2, save_after=STEPS - 1, save=folder)
    assert (folder / ".metadata").is_file()
    resumed = ranks(tmp_path, job | {"batches": job["batches"][-1:]}, 1, load=folder)
    assert_same_training(resumed["weights"], both["weights"], job["weights"])


def test_a_one_process_state_becomes_shards_and_back(tmp_path, job):
    """A learner may change its worker count: the one-process state (weights and AdamW state_dict)
    written as shards trains on 2 ranks as it would have in one process, and reads back exactly."""
    folder = tmp_path / "shards" / "from-one"
    names = [n for n, _ in fresh_model(job).named_parameters()]
    saved = {}

    def keep(model, opt):
        saved.update(model=copy.deepcopy(model.state_dict()), opt=copy.deepcopy(opt.state_dict()))
        write_shards(folder, saved["model"], saved["opt"], names)

    one_process(job, job["batches"][:-1], then=keep)
    want, _ = one_process(job, job["batches"])
    got = ranks(tmp_path, job | {"batches": job["batches"][-1:]}, 2, load=folder)
    assert_same_training(got["weights"], want, job["weights"])

    def check(model, opt):
        read_shards(folder, model, opt)
        assert all(torch.equal(v, saved["model"][k]) for k, v in model.state_dict().items())
        back = opt.state_dict()
        assert back["state"].keys() == saved["opt"]["state"].keys()
        for i, st in saved["opt"]["state"].items():
            assert all(torch.equal(back["state"][i][f], v) for f, v in st.items())

    one_process(job, [], start=check)


def test_a_one_process_learner_takes_over_a_sharded_state(tmp_path, job):
    """Workers N -> 1: a one-process learner finds markers naming shards (as workers leave them) and
    turns them back into its own files, with the same weights, optimizer state and step."""
    s = job["settings"].model_copy(update={"data_dir": tmp_path / "data"})
    lr = Learner(s, producer=ListProducer())
    lr.start()
    lr.buffer.add(job["batches"][0])
    assert lr.update() is not None
    want_model, want_opt = copy.deepcopy(lr.model.state_dict()), copy.deepcopy(lr.opt.state_dict())
    for marker in (STATE_FILE, LAST_GOOD_FILE):
        lr._sharded_marker(marker)  # what a data-parallel learner does with a one-process file at start
        assert "model" not in torch.load(lr.dir / marker, weights_only=False)

    again = Learner(s, producer=ListProducer())
    again.start()
    assert again.state.step == 1 and not (again.dir / SHARDS_DIR).exists()
    assert all(torch.equal(v, want_model[k]) for k, v in again.model.state_dict().items())
    got_opt = again.opt.state_dict()["state"]
    assert got_opt.keys() == want_opt["state"].keys()
    assert all(torch.equal(got_opt[i]["exp_avg"], st["exp_avg"]) for i, st in want_opt["state"].items())
