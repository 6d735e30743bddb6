"""Checkpoint conversion between megatron_sat (Megatron dist checkpoints) and Hugging Face.

    python tools/convert_to_hf.py --load RUN_OR_ITER_DIR --output HF_DIR [--dtype bfloat16] [--verify]
    python tools/convert_from_hf.py --hf HF_DIR --save RUN_DIR [trainer flags, e.g. layout and LR schedule]

SATFormer, ResFormer and the DenseFormer, MUDDFormer and Hyper-Connections baselines are written with
the SATFormer authors' classes, config fields and weight names (pure-PyTorch modeling code shipped in
the folder: trust_remote_code=True); the Transformer baseline as transformers' Qwen3 (a subclass in the
folder gives its q/k norms their own eps). Modules:
    mapping      ModelSpec, HF configs, weight names and layouts (torch only)
    hf_io        HF folders: read (shards checked), write aside and move into place
    megatron_io  checkpoints, recorded configuration, the TP1/PP1 model in one CPU process
    export       export_checkpoint (Megatron -> HF)
    importer     import_hf (HF -> a checkpoint the trainer's --load accepts)
"""

from megatron_sat.conversion.mapping import ConversionError, ModelSpec

__all__ = ["ConversionError", "ModelSpec", "export_checkpoint", "import_hf"]


def export_checkpoint(*args, **kwargs):
    # imported on call: export imports this package (a circle), and importing mapping (torch only) through this
    # package must not pull megatron-core and transformers
    from megatron_sat.conversion.export import export_checkpoint as run

    return run(*args, **kwargs)


def import_hf(*args, **kwargs):
    # imported on call, as export_checkpoint above
    from megatron_sat.conversion.importer import import_hf as run

    return run(*args, **kwargs)
