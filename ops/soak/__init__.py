"""`flywheel soak`: the whole loop under injected faults, and proof that nothing was lost.

settings.py   `[soak]`: how long, which faults, which database, the bounds on each wait
postgres.py   a throwaway PostgreSQL server the soak can crash and start again
children.py   `flywheel sink` and `flywheel learn` as processes it can SIGKILL and restart
faults.py     the faults, each a function of the running loop
checks.py     the checks, pure: the editors' ledger against SQL and the weight store
run.py        the run: its own stack, the loop, the faults, the checks and their table
"""
