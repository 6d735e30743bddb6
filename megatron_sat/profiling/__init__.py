"""Measuring the model: throughput and memory (throughput.py, report.py, settings.py), step benchmarks
(step_benchmark.py), traces and FLOPs profiles (detail.py) and the dry run at scale (dry_run.py).
The analytic FLOPs per arch live with the model (megatron_sat.model.flops)."""
