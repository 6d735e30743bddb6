"""Measuring the model: throughput and memory (throughput.py, report.py, settings.py), step benchmarks
(step_benchmark.py), traces and FLOPs profiles (detail.py), the dry run at scale (dry_run.py) and, before any
GPU is held, the step-time model (steptime/, torch-free; docs/step_time.md).
The analytic FLOPs per arch live with the model (megatron_sat.model.flops)."""
