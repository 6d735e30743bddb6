"""Model analysis: gate telemetry while training (gates.py), the gate report of an export (gate_report.py)
and lm-eval evaluation (evaluation.py, lm_eval_tasks/)."""

from megatron_sat.analysis.gates import GateTelemetry

__all__ = ["GateTelemetry"]
