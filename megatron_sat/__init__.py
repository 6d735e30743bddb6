"""megatron-sat: pretraining codebase for SATFormer built on NVIDIA Megatron-Core.

CPU support (gloo, no GPU) lives in one place: :mod:`megatron_sat.compat`.
"""

__version__ = "0.1.0"
