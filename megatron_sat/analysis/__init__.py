"""Model analysis: gate telemetry."""

from megatron_sat.analysis.gates import GateTelemetry

__all__ = ["GateTelemetry"]
