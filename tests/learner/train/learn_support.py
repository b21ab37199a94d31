"""Shared by the learner tests: a tiny pretrained base and rewarded samples written to SQL the
way the sink writes them (completions, completion_choices, rewards)."""

from __future__ import annotations

import shutil
import uuid
from datetime import UTC, datetime
from pathlib import Path

import torch

from feedback import db
from feedback.routing import encode_routing
from learner.corpus import default_corpus_dir
from learner.tokenizer import EOS
from learner.train.learn import Sample
from learner.train.learn_settings import LearnSettings

FILES = ["textwrap.py", "shlex.py", "string.py", "fnmatch.py", "glob.py", "bisect.py", "heapq.py", "colorsys.py"]


def make_corpus(root: Path) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    for name in FILES:
        shutil.copy(default_corpus_dir() / name, root / name)
    return root


def tiny_pretrain(corpus: Path, **overrides) -> dict:
    """[pretrain] settings of a throwaway 8-step `tiny` model on `corpus`."""
    return (
        dict(
            corpus=str(corpus),
            size="tiny",
            vocab_size=400,
            seq_len=96,
            batch_size=4,
            steps=8,
            warmup_steps=2,
            eval_every=4,
            eval_windows=4,
            final_eval_windows=8,
            checkpoint_minutes=1000,
            heldout_fraction=0.25,
            quality_check=False,
        )
        | overrides
    )


def tiny_learn_settings(tmp: Path, corpus: Path, cache: Path, **learn) -> LearnSettings:
    pretrain = tiny_pretrain(corpus)
    learn = (
        dict(
            publish_every=1, min_samples=8, batch_size=4, poll_s=0.1, gate={"sites": 6, "max_tokens": 8, "min_sites": 4}
        )
        | learn
    )
    return LearnSettings(data_dir=tmp / "data", cache_dir=cache, pretrain=pretrain, learn=learn)


class ListProducer:
    """Stands in for feedback.producer.BufferedProducer (send / flush / close) in unit tests."""

    def __init__(self):
        self.sent = []

    def send(self, topic, msg):
        self.sent.append((topic, msg))
        return True

    def flush(self, timeout_s=30.0):
        return True

    def close(self, timeout_s=10.0):
        pass


@torch.no_grad()
def sample_completion(
    model, prompt: list[int], max_new: int, eos: int, *, abstain: bool = False, temperature: float = 1.0, gen=None
):
    """Sample from `model` (the served weights) like the replica does, until the `eos` token;
    logprobs are the raw ones."""
    if abstain:
        lp = torch.log_softmax(model(torch.tensor([prompt]))[0, -1].float(), -1)
        return [eos], [float(lp[eos])]
    ids, toks, lps = list(prompt), [], []
    for _ in range(max_new):
        lp = torch.log_softmax(model(torch.tensor([ids[-model.args.max_seq_len :]]))[0, -1].float(), -1)
        t = int(torch.multinomial((lp / temperature).softmax(-1), 1, generator=gen))
        toks.append(t)
        lps.append(float(lp[t]))
        ids.append(t)
        if t == eos:
            break
    return toks, lps


def fim_prompts(tok, files, n: int, window: int, seed: int = 3) -> list[list[int]]:
    """Editor-request prompts (serving's FIM layout) at cursor sites of `files`."""
    import random

    from learner import eval as E
    from learner.formats import own_format
    from learner.judge import cursor_sites

    builder = E.prompt_builder(tok, own_format(tok, window), window)
    return [E.site_prompt(builder, site)[0] for site in cursor_sites(files, n, random.Random(seed))]


def write_samples(
    engine,
    model,
    tok,
    texts: list,
    *,
    version: int = 0,
    reward_fn=None,
    seed: int = 0,
    max_new: int = 6,
    user: str | None = None,
    pinned: bool = False,
) -> list[str]:
    """One completion per text (its tail as the prompt; or a list of prompt ids), rewarded by
    `reward_fn(token_ids) -> (reward, outcome)`; from five users in turn, or all from `user`."""
    gen = torch.Generator().manual_seed(seed)
    eos = tok.token_to_id(EOS)
    ids = []
    now = datetime.now(UTC)
    with engine.begin() as conn:
        for i, text in enumerate(texts):
            prompt = list(text) if isinstance(text, list) else tok.encode(text).ids[-40:] or [eos]
            abstain = (
                reward_fn is not None and getattr(reward_fn, "abstain_every", 0) and i % reward_fn.abstain_every == 0
            )
            toks, lps = sample_completion(model, prompt, max_new, eos, abstain=bool(abstain), gen=gen)
            reward, outcome = (
                reward_fn(toks) if reward_fn else (1.0 if i % 2 else -0.25, "select" if i % 2 else "dismiss")
            )
            cid = f"c-{uuid.uuid4().hex}"
            insert_completion(
                conn,
                cid,
                version,
                prompt,
                toks,
                lps,
                user=user or f"u{i % 5}",
                pinned=pinned,
                text=tok.decode(toks),
                n_chars=len(tok.decode([t for t in toks if t != eos])),
                created_at=now,
            )
            conn.execute(
                db.rewards.insert().values(
                    completion_id=cid,
                    choice_index=0,
                    model_version=version,
                    reward=reward,
                    components={"outcome": outcome},
                    outcome=outcome,
                )
            )
            ids.append(cid)
    return ids


def rerouted_samples(model, n: int, *, reroute_every: int, version: int = 3, seed: int = 0) -> list[Sample]:
    """n completions as a serving engine that routes like `model`, except that at every
    `reroute_every`-th (position, layer) pair it took other experts (FP4 serving weights do that at
    a few positions), records them: vLLM's logprobs come from its routes, and the trace carries them."""
    gen = torch.Generator().manual_seed(seed)
    samples = []
    for i in range(n):
        seq = torch.randint(2, model.args.vocab_size, (1, 14 + i % 5), generator=gen)
        x = seq[:, :-1]
        with torch.no_grad():
            _, own = model(x, return_routing=True)
            routes = []
            for layer, r in enumerate(own):
                r = r.clone()
                if reroute_every:
                    where = torch.zeros(r.shape[1], dtype=torch.bool)
                    where[(layer + i) % reroute_every :: reroute_every] = True
                    r[0, where] = (r[0, where] + 1) % model.args.n_experts
                    # top-k picks distinct experts: a shifted pair may collide, so shift both together
                    r[0, where, 1] = (r[0, where, 0] + 1) % model.args.n_experts
                routes.append(r)
            logp = torch.log_softmax(model(x, routing=routes)[0].float(), -1)
        prompt, completion = seq[0, :10].tolist(), seq[0, 10:].tolist()
        behaviour = [float(logp[9 + t, tok]) for t, tok in enumerate(completion)]
        trace = torch.stack([r[0] for r in routes]).numpy()  # [L, positions, K]: prompt + completion - 1
        samples.append(
            Sample(
                0, f"c-{uuid.uuid4().hex}", 0, version, prompt, completion, behaviour, 0.0, None, encode_routing(trace)
            )
        )
    return samples


def record_served(engine, samples) -> None:
    """`samples` as the sink records completions: the version that served each, its prompt, and
    its choice's tokens, logprobs and routing trace (no reward: not every completion gets one)."""
    with engine.begin() as conn:
        for s in samples:
            insert_completion(
                conn, s.completion_id, s.version, s.prompt_ids, s.token_ids, s.behaviour, routing=s.routing
            )


def insert_completion(
    conn,
    cid: str,
    version: int,
    prompt,
    toks,
    lps,
    *,
    user="u0",
    pinned=False,
    text="",
    n_chars=0,
    routing=None,
    created_at: datetime | None = None,
) -> None:
    """One completion and its one choice, as the sink writes them."""
    conn.execute(
        db.completions.insert().values(
            completion_id=cid,
            model_version=version,
            user_hash=user,
            pinned=pinned,
            prompt_token_ids=prompt,
            summary_ids=[],
            n_choices=1,
            latency_ms=10.0,
            created_at=created_at or datetime.now(UTC),
        )
    )
    conn.execute(
        db.completion_choices.insert().values(
            completion_id=cid,
            choice_index=0,
            token_ids=toks,
            logprobs=lps,
            routing=routing,
            text=text,
            n_chars=n_chars,
            finish_reason="stop",
        )
    )


def reward_ids(engine) -> list[int]:
    with engine.connect() as conn:
        return list(
            conn.execute(db.rewards.select().with_only_columns(db.rewards.c.id).order_by(db.rewards.c.id)).scalars()
        )


def train_ranks(rank: int, world: int, port: int, job: Path) -> None:
    """One rank of a gloo group on this machine (torch.multiprocessing.spawn's target): loads
    `job` ({"weights", "setup", "batches", "load", "save_after", "out"}), trains each batch with a
    data_parallel.Replica, saves its checkpoint after `save_after` batches, and rank 0 writes the
    weights and each update's metrics to `out`."""
    import os
    import sys

    import torch.distributed as dist

    from learner.model import Transformer
    from learner.train.data_parallel import Replica

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        spec = torch.load(job, weights_only=False)
        model = Transformer(spec["setup"].args)
        model.load_state_dict(spec["weights"])
        replica = Replica(model, spec["setup"], "cpu")
        if spec.get("load"):
            replica.load(spec["load"])
        metrics = []
        for i, samples in enumerate(spec["batches"]):
            if spec.get("save_after") == i:
                replica.save(spec["save"])
            metrics.append(replica.update(samples))
        if rank == 0:
            torch.save({"weights": model.state_dict(), "metrics": metrics}, spec["out"])
        dist.barrier()  # leave together: every rank's work and output are done
    except BaseException:
        dist.destroy_process_group()
        raise
    # Exit without tearing gloo down: its teardown aborted a rank now and then, after a barrier too
    # ("terminate called without an active exception" from a background thread's destructor: one
    # two-rank checkpoint run in three on a fresh install, one run in about 13 of these tests on
    # another machine), failing a run whose work was done. The learner's own workers run under Ray
    # Train, which tears its groups down itself.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
