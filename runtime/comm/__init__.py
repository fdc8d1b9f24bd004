"""Process groups and the collectives every engine calls.

- `groups.py`: the plan's mesh (rank -> pipeline stage, replica, tensor slice) as c10d process groups,
  created by every rank in one order;
- `collectives.py`: the shim every collective goes through: it counts them (tests compare the counts with
  the plan's) and picks the implementation (reduce-scatter as itself, or all-reduce then slice on Gloo).
"""
