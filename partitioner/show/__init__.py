"""Presentations of a plan (beside the code generator, above the planner): `Plan` -> what a person reads.

- `text.py`: `print(plan)` and `plan.explain()` (the table, the decisions and why, the alternatives);
- `timeline.py`: the pipeline schedule as a timeline (JSON for chrome://tracing, PNG);
- `html.py`: the plan page, one self-contained HTML file.

Read first: `text.py`. Nothing here changes a plan or imports the code generator.
"""
