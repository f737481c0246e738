"""The pipeline wing: planning, simulating and searching a pipeline-parallel layout's clocks, and its clock table."""
