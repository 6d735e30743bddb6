"""Parallel layouts: validation and process groups, the pipeline schedule, gradient finalisation."""
