"""`flywheel learn --workers N` (N > 1): the learner on Ray Train, data-parallel.

    flywheel learn (the driver)           Ray Train TorchTrainer: N workers, torch.distributed
      a private local Ray instance          (gloo on CPUs, NCCL on GPUs)
      shows rank 0's progress     <-queue-  rank 0: the Learner (learn.py): SQL, buffer, gate, publish,
      Ctrl-C / SIGTERM            -queue->          and its replica (data_parallel.py)
                                            rank 1..N-1: replicas that follow rank 0's commands

Delivery is the one-process learner's: every update saves (each rank its shards, then rank 0 the
marker naming them), so a SIGKILL of the driver or of any worker resumes with each sample trained
exactly once per saved state. The workers die with the driver; rank 0 takes a lock on the
learner's folder, so a restarted learner waits until no worker of the previous one is left.
"""

from __future__ import annotations

import fcntl
import logging
import os
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

from feedback.core.files import private_dir
from learner.train.learn import Progress
from learner.train.learn_settings import LearnSection, LearnSettings

log = logging.getLogger(__name__)

LOCK_FILE = "learner.lock"
RAY_START_ATTEMPTS = 3
LOCK_WAIT_S = 60.0  # a killed driver's workers exit within seconds (Ray kills a dead driver's workers)


def run_workers(
    s: LearnSettings,
    *,
    progress: Callable[[Progress], None],
    stop: threading.Event,
    max_versions: int | None = None,
    until_idle: bool = False,
) -> None:
    """Run the learner on `learn.workers` Ray Train workers until rank 0's loop returns or `stop` is set."""
    from ray.util.queue import Empty, Queue

    from feedback.core.errors import UserError, first_line

    with local_ray(s.learn.workers):
        events, control = Queue(), Queue()
        config = {
            "settings": s,
            "events": events,
            "control": control,
            "max_versions": max_versions,
            "until_idle": until_idle,
        }
        failure: list[BaseException] = []
        errors: list[str] = []

        def fit() -> None:
            try:
                torch_trainer(_worker, config, s.learn, Path(s.learner_dir) / "ray").fit()
            except BaseException as e:  # handed to the caller's thread below
                failure.append(e)

        fitting = threading.Thread(target=fit, name="ray-train-fit", daemon=True)
        fitting.start()
        asked_to_stop = False
        while fitting.is_alive() or not events.empty():
            if stop.is_set() and not asked_to_stop:
                control.put("stop")
                asked_to_stop = True
            try:
                kind, what = events.get(timeout=0.2)
            except Empty:
                continue
            if kind == "progress":
                progress(what)
            else:
                errors.append(what)
        fitting.join()
        if errors:
            raise UserError(errors[0])
        if failure and not isinstance(failure[0], KeyboardInterrupt):
            # A worker died (killed, out of memory) or raised; Ray printed its traceback above.
            raise UserError(
                f"a learner worker failed ({first_line(failure[0])}); the state saved after the last "
                "update is intact: run `flywheel learn` again to resume from it"
            ) from failure[0]


@contextmanager
def local_ray(workers: int):
    """A Ray instance of this process's own (address="local": never a cluster another program
    started on this machine), shut down on exit; its workers die with this process."""
    import ray

    from feedback.core.errors import UserError

    for attempt in range(1, RAY_START_ATTEMPTS + 1):
        try:
            ray.init(
                address="local",
                num_cpus=max(os.cpu_count() or 1, workers),
                include_dashboard=True,  # Ray Train's placement-group cleaner asks the state API, which the dashboard serves
                log_to_driver=True,
                configure_logging=False,
            )
            break
        except Exception as e:  # Ray waits a fixed 30 s for its raylet: an overloaded machine can miss that
            ray.shutdown()
            if "timed out during startup" not in str(e):
                raise
            if attempt == RAY_START_ATTEMPTS:
                raise UserError(
                    f"Ray's local instance did not start ({attempt} tries: its raylet missed Ray's 30 s start-up "
                    "wait; is this machine overloaded?): try again, or run with learn.workers = 1"
                ) from None
            log.warning("Ray's local instance did not start in time (try %d of %d)", attempt, RAY_START_ATTEMPTS)
    try:
        yield
    finally:
        ray.shutdown()


def torch_trainer(fn: Callable[[dict], None], config: dict, cfg: LearnSection, storage: Path):
    """A Ray Train TorchTrainer running `fn(config)` on `cfg.workers` workers: gloo on CPUs, NCCL on GPUs."""
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    return TorchTrainer(
        fn,
        train_loop_config=config,
        scaling_config=ScalingConfig(num_workers=cfg.workers, use_gpu=cfg.gpu),
        torch_config=TorchConfig(backend="nccl" if cfg.gpu else "gloo"),
        run_config=RunConfig(
            name="learn",
            storage_path=str(storage.resolve()),
            failure_config=FailureConfig(max_failures=0),  # a restart resumes from the saved state instead
        ),
    )


def worker_device(cfg: LearnSection) -> str:
    import ray.train.torch

    return str(ray.train.torch.get_device()) if cfg.gpu else "cpu"


def _worker(config: dict) -> None:
    """One Ray Train worker: rank 0 runs the Learner, the others follow it."""
    import ray.train

    from feedback.core.errors import UserError
    from learner.train.data_parallel import follow, leader
    from learner.train.learn import Learner

    # The CLI's logging (warnings and up): a Ray worker's root logger passes debug records to the driver.
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s", force=True)
    s: LearnSettings = config["settings"]
    device = worker_device(s.learn)
    if ray.train.get_context().get_world_rank() != 0:
        follow(device)
        return
    events = config["events"]
    try:
        with _exclusive(s.learner_dir):
            stop = threading.Event()
            threading.Thread(target=lambda: (config["control"].get(), stop.set()), daemon=True).start()
            learner = Learner(s, progress=lambda p: events.put(("progress", p)), device=device, leader=leader)
            try:
                learner.start()
                learner.run(stop, max_versions=config["max_versions"], until_idle=config["until_idle"])
                learner.leader.stop()
            finally:
                learner.close()
    except UserError as e:
        events.put(("error", str(e)))
        raise


class _exclusive:
    """An exclusive lock on the learner's folder for this process's life (the kernel drops it when
    the process dies): two learners never write one state."""

    def __init__(self, folder: Path):
        self.path = private_dir(Path(folder)) / LOCK_FILE

    def __enter__(self):
        from feedback.core.errors import UserError

        self.f = open(self.path, "a")  # held until __exit__
        deadline = time.monotonic() + LOCK_WAIT_S
        while True:
            try:
                fcntl.flock(self.f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return self
            except BlockingIOError:
                if time.monotonic() > deadline:
                    self.f.close()
                    raise UserError(
                        f"another learner holds {self.path} (waited {LOCK_WAIT_S:.0f} s): stop it first"
                    ) from None
                time.sleep(0.2)

    def __exit__(self, *exc):
        self.f.close()
