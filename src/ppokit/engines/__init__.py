"""Rollout engines: what samples the episodes of an update (`base.RolloutEngine`).

`ENGINES` names every engine `rollout.engine` may take; `build` makes one. Importing this package
imports no torch (the config reads ENGINES).
"""
