"""`[soak]`: the typed config of `flywheel soak` (light: no torch, no Ray)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field

from feedback.core.config import Seconds, Section
from feedback.sink.loop import SinkSection, SinkSettings
from learner.train.learn_settings import GateSection, LearnSection, LearnSettings
from ops.rollout.settings import RolloutSection, RolloutSettings
from ops.simulate import SimulateSection, SimulateSettings
from serving.settings import ServingSettings

Fault = Literal["broker", "sink", "postgres", "replica", "learner", "corrupt_delta"]
FAULTS: tuple[Fault, ...] = ("broker", "sink", "postgres", "replica", "learner", "corrupt_delta")


class SoakSection(Section):
    minutes: float = Field(default=10.0, gt=0)
    """How long the simulated editors work while faults are injected. The first round of faults
    always completes, so a short soak runs as long as that takes."""
    faults: list[Fault] = list(FAULTS)
    """The faults to inject, in this order, a round after another while time remains."""
    database: Literal["sqlite", "postgresql"] = "sqlite"
    """The soak's own database: a SQLite file in its folder, or a throwaway PostgreSQL server it starts
    itself (initdb, pg_ctl) and restarts as a fault. On SQLite that fault is skipped, and the table says so."""
    postgres_bin: Path | None = None
    """The folder of PostgreSQL's initdb and pg_ctl. Empty: `pg_config --bindir`, else the newest
    /usr/lib/postgresql/*/bin, else the PATH."""
    postgres_os_user: str = "postgres"
    """The account that runs the throwaway PostgreSQL server when the soak runs as root (PostgreSQL
    refuses to run as root)."""
    warmup_s: Seconds = Field(default=60.0, ge=0)
    """Calm before the first fault: the loop runs undisturbed for this long."""
    gap_s: Seconds = Field(default=30.0, ge=0)
    """Calm between two faults, so each one's effects are its own."""
    broker_down_s: Seconds = Field(default=20.0, ge=0)
    """How long the Kafka broker stays stopped."""
    postgres_down_s: Seconds = Field(default=10.0, ge=0)
    """How long PostgreSQL stays down before it is started again (it recovers from its WAL)."""
    fault_timeout_s: Seconds = Field(default=600.0, gt=0)
    """The longest a fault waits for its moment or for the loop to recover (a publish to begin, a
    killed replica to run again); past it the fault counts as failed and so does the soak."""
    restart_grace_s: Seconds = Field(default=15.0, ge=0)
    """Once a killed replica runs again, how much longer a 503 still counts as its restart's (the
    ingress learns of the new replica a little later)."""
    drain_timeout_s: Seconds = Field(default=300.0, gt=0)
    """After the editors stop, the longest the soak waits for everything they were answered to reach
    SQL before it checks (a missing row is then a failed check, not a wait)."""


class SoakSettings(SimulateSettings, ServingSettings, SinkSettings, LearnSettings, RolloutSettings):
    """`flywheel soak`: every section the loop uses, with a learner that publishes every minute, short
    feedback windows and canary steps, so a ten-minute soak sees several versions and rollouts. The
    store keeps every version: the checks verify each one."""

    soak: SoakSection = SoakSection()
    sink: SinkSection = SinkSection(feedback_window_s=10.0, grace_period_s=60.0)
    simulate: SimulateSection = SimulateSection(users=4, rate=1.5, edit_delay_s=2.0, max_tokens=16)
    learn: LearnSection = LearnSection(
        publish_every=60.0,
        min_samples=32,
        keep_versions=1_000_000,
        gate=GateSection(sites=16, min_sites=16, max_tokens=16, max_kl=0.5),
    )
    rollout: RolloutSection = RolloutSection(  # no_harm: rollouts end within the soak's minutes, not after holds
        auto=True,
        weights=[50.0, 100.0],
        interval_s=20.0,
        min_samples=8,
        max_holds=6,
        poll_s=2.0,
        promote_rule="no_harm",
    )
