"""Command-line tools. Run them from the repository as `python tools/NAME.py ...`, or through the console scripts
that `pip install -e .` puts on PATH (this folder is installed as the package `megatron_sat_tools`):
megatron-sat-convert-to-hf, megatron-sat-convert-from-hf, megatron-sat-preprocess-data, megatron-sat-evaluate,
megatron-sat-analyze-gates, megatron-sat-plan-layout, megatron-sat-submit-grid, megatron-sat-collect-grid,
megatron-sat-merge-datasets (and megatron-sat-train from the library)."""
