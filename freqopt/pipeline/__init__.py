"""The pipeline: a pipeline-parallel iteration's instruction DAG and schedules, its clock planner (stage profile,
hull LP and MILP, heuristics, frontier), the simulated pipeline, and the pipeline's clock search and stragglers."""
