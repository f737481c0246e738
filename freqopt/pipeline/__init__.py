"""The pipeline wing: a pipeline-parallel iteration's instruction DAG and schedules, its clock planner (stage profile,
hull LP and MILP, heuristics, frontier), the simulated pipeline, the pipeline's clock search and stragglers, and its
clock table (a plan as a table)."""
