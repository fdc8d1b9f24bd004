"""Cost models: hardware (Topology) and the time/memory formulas the planner uses.

Imports nothing else of the project (shared/DESIGN.md, rules of the house).
"""
