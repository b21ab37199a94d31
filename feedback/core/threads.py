"""CPU worker threads that sleep when they have nothing to do, so a shared machine stays usable.

torch's CPU build parallelizes with GNU OpenMP (libgomp). By default an OpenMP thread that
finishes its share of a parallel region spins for a while before it sleeps, betting that the
next region starts soon. On an idle machine that bet pays a little. On a machine where other
processes want the same cores, it is ruinous: a spinning thread holds a core that the thread
the region is waiting for needs, and every region ends at the pace of the slowest, descheduled
thread. Measured on 2 cores beside other busy processes (one pretraining step of the `small`
model, torch 2.13+cpu, 2 threads): 40.8 s a step by default, 7.8 s with `OMP_WAIT_POLICY=PASSIVE`,
6.3 s with one thread. A Flywheel machine always shares its cores (vLLM replicas, the learner,
the sink and the broker run side by side on one box), so every Flywheel process asks for
passive waiting, and the processes it starts (Ray workers, vLLM's engine core) inherit it.

libgomp reads the variable once, when it loads, so `prefer_passive_waiting()` must run before
torch is imported; the `flywheel` command and the test session call it first thing. A value the
user set is kept.
"""

from __future__ import annotations

import os

WAIT_POLICY = "OMP_WAIT_POLICY"


def prefer_passive_waiting() -> None:
    """Ask OpenMP threads to sleep, not spin, when idle (unless OMP_WAIT_POLICY is already set)."""
    os.environ.setdefault(WAIT_POLICY, "PASSIVE")
