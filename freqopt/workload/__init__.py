"""The workload: what is trained and the GPU kernels one rank runs for it.

Parallel layouts (layout), the models (models/), the kernels of a traced iteration as data (kernels), where a
running job can switch clocks (phases) and which module a trace belongs to (fingerprint), the tracers of a
built-in model or a user's own step (trace, step_trace), a pipeline layout's stages (pipeline_partition: DeepSpeed's
partition of the layers; pipeline_trace: each stage's micro-batch), the memory a step holds (memory), and real DeepSpeed
steps that the traces are checked against (deepspeed_profile). Imports nothing of the wings above it.
"""
