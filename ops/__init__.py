"""Ops: the `flywheel` command line, the local stack, rollouts, dashboard, simulation, benchmarks."""
