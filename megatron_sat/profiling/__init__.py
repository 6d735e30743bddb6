"""Throughput accounting: analytic FLOPs per arch and peak device FLOPs (for MFU)."""

from megatron_sat.model.flops import flops_breakdown, flops_per_token, peak_flops_per_device

__all__ = ["flops_breakdown", "flops_per_token", "peak_flops_per_device"]
