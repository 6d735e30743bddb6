"""A step-time model for Megatron-Core training on GPUs, torch-free: what one step costs for a model (its ModelArgs),
a parallel layout and a cluster, before the allocation (docs/step_time.md).

    from megatron_sat.model.args import ModelArgs
    from megatron_sat.steptime import Layout, cluster, predict_step
    p = predict_step(ModelArgs(arch="transformer", num_layers=24, hidden_size=2048, num_attention_heads=32),
                     Layout(dp=8, micro_batch_size=2, global_batch_size=512), cluster("1x8xH100"),
                     seq_length=4096, vocab_size=32000)
    p.step_time_s, p.tflops_per_gpu, p.mfu, p.tokens_per_s, p.bubble_share, p.exposed_comm_share, p.breakdown

Modules (one job each):
    gpus.json      the GPUs (peaks, HBM, NVLink, network, memory) with their sources and calibration constants
    hardware.py    Hardware, Cluster, load_gpu, gpu_names, cluster("4x8xH100")
    roofline.py    operators (GEMM, flash attention, memory-bound) on a roofline with efficiency curves
    collectives.py ring / tree collectives and pipeline sends on intra- and inter-node links
    arch_ops.py    asks the arch modules (Arch.step_ops) what each adds to the Transformer block
    layer_costs.py a layer's and a stage's forward / backward costs, TP / CP communication, recompute
    schedule.py    the pipeline schedule simulated as Megatron-Core runs it (1F1B, interleaved)
    predict.py     Layout, StepPrediction, predict_step
    published.py   the published Megatron throughput tables and the model's comparison with them
"""

from megatron_sat.steptime.hardware import Cluster, Hardware, cluster, gpu_names, load_gpu
from megatron_sat.steptime.predict import Layout, StepPrediction, layout_from_args, predict_step

# the model's relative error band: the mean absolute error of its predictions of the published rows it was not
# fitted on (published.py, docs/step_time.md; tests/test_steptime.py keeps it equal to the model's), for GPU hours
# (prediction x (1 +- this)); published.uncertainty(gpu) gives one GPU's own where it has published rows
STEP_TIME_ERROR = 0.105

__all__ = ["STEP_TIME_ERROR", "Cluster", "Hardware", "Layout", "StepPrediction", "cluster", "gpu_names",
           "layout_from_args", "load_gpu", "predict_step"]
