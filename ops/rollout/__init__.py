"""Canary rollouts: start, watch, advance, promote or roll back a model version.

A rollout moves a candidate version through traffic steps (`weights`, percent of users, by
default 5, 25, 50, 100). At each step the controller waits `interval_s`, then compares the
canary (completions served by the candidate) with stable (served by the stable version)
over the step's time window, from the SQL tables, and decides (stats.py):

  rollback  a guarded metric is significantly worse (or p99 latency over its ratio), or a
            step stayed under-sampled for `max_holds` evaluations ("insufficient traffic"),
            or the last step could not show the canary non-inferior (or its expected loss
            within bound) in as many;
  hold      too few samples yet, or (last step) not yet enough evidence that the canary's
            accept rate is within the tolerance of stable's: look again `interval_s` later,
            with the window still open;
  advance   enough samples and no significant harm: the next weight;
  promote   at the last weight, the canary's accept rate shown non-inferior (the default
            `promote_rule`; `expected_loss`: the expected loss of accept rate from promoting it
            within `accept_rate_loss`; `no_harm`: no significant harm is enough): the candidate
            becomes stable.

All state is in SQL, nothing in the process, so a controller can die and restart anywhere:

  - `rollouts` holds the state (running, paused, promoted, rolled_back, aborted: spelled in
    feedback/db.py), the step index and the policy the rollout began with (weights,
    interval, min_samples, thresholds);
  - `rollout_steps` holds every decision with its evidence. A step's window begins at the
    `advance` row that opened it (the rollout's `started_at` for the first), the next
    evaluation is due `interval_s` after the latest row of any kind, and the holds of a step
    are its `hold` rows;
  - the serving topology (`serving_pools`, feedback/pools.py) follows the rollout. A
    decision is committed first and the pools written after it; each controller pass
    compares the pools with the latest rollout and repairs a write that failed.

At weight 100 stable serves nobody, so the stable arm there is all of stable's traffic from
one interval before the rollout began until now (a historical control).

Decisions are compare-and-set updates on (state, step, updated_at): two controllers, or a
controller and an operator, never both act on the same step. One rollout may be active
(running or paused) at a time, and (unless forced) a version is rolled out once.

The modules, bottom to top (each imports only those above it):

  stats       the statistics and decision rules: pure functions, no I/O
  settings    the `[rollout]` section: the policy new rollouts get, how the controller runs
  rows        the rollouts and rollout_steps tables: reads, and the guarded writes
  topology    the serving pools a rollout's state asks for: apply, and repair
  arms        one version's traffic in a time window, from the sink's tables
  commands    starting a rollout; the operator's pause, resume, promote, abort
  auto        auto mode: roll out the versions the learner announces
  controller  one pass (`tick`) and the loop that runs it (`run_controller`)
  routes      the same commands over HTTP (/ops/rollouts)
"""
