"""Modeling code copied into SATFormer / ResFormer exports (configuration_<arch>.py, modeling_<arch>.py)."""
