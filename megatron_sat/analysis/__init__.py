"""Model analysis after training: the gate report of an export (gate_report.py), lm-eval evaluation
(evaluation.py, lm_eval_tasks/) and sweep results (grid.py, scaling.py, the tables and figures).
Gate telemetry while training lives with the trainer (megatron_sat/training/gate_telemetry.py)."""
