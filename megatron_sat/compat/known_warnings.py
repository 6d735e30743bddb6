"""The third-party warnings this project knows to be harmless here, filtered by their exact message and module, in
this one place (set MEGATRON_SAT_VERBOSE=1 to see them all). Imports neither megatron nor lm-eval: `quiet()` runs before
they are imported, since megatron-core warns at import.

- megatron-core, on a machine without Transformer Engine and Apex (every CPU run here: the compatibility layer,
  cpu.py, runs megatron-core's torch fallbacks on purpose), warns at import of its optimizer, optimizer.optimizer and
  clip_grads modules (and Megatron-FSDP's mixed_precision) that it falls back to torch's optimizers and its local
  multi-tensor functions (and its torch norm in place of Apex's); those fallbacks are what a CPU run uses. Its
  import of megatron.core.models also announces the experimental MIMO config, which nothing here builds, and its
  TransformerConfig a deprecated CUDA-graph scope default; its distributed optimizer calls two torch collectives that
  torch marks deprecated, and its dist checkpointing loads through torch's, which notes its argument order and, read
  in one process, that it assumes one process.
- megatron-core's tensor-parallel layers recommend CUDA_DEVICE_MAX_CONNECTIONS=1 for overlapping a GPU's gradient
  all-reduce: on CPU that means nothing, so cpu.py (where the project knows there is no GPU) filters it there.
- lm-eval's evaluation (the megatron_sat backend and tools/evaluate.py): the note that a task with a custom dataset
  loader takes kwargs from --metadata (the tiny test tasks load their data beside their YAML that way).
"""

import logging
import os
import re
import warnings

# (message start, category, the modules that warn it): exact, as -W and PYTHONWARNINGS take them
WARNINGS = (
    ("Transformer Engine and Apex are not installed", UserWarning,
     ("megatron.core.optimizer", "megatron.core.optimizer.optimizer", "megatron.core.optimizer.clip_grads",
      "megatron.core.distributed.fsdp.src.megatron_fsdp.mixed_precision")),
    ("Apex is not installed. Falling back to Torch Norm", UserWarning,
     ("megatron.core.models.backends", "megatron.core.models.gpt.gpt_layer_specs")),
    # imported by megatron.core.models whether or not a MIMO model is built (none is here)
    ("MimoModelConfig is experimental", UserWarning, ("megatron.core.models.mimo.config.base_configs",)),
    # megatron-core builds its TransformerConfig with its own default cuda_graph_scope; no CUDA graphs are made here
    ("full scope is deprecated", UserWarning, ("megatron.core.transformer.transformer_config",)),
    # torch's distributed checkpoint, as megatron-core's dist checkpointing calls it to load: a note on its own argument
    # order, and, where a checkpoint is read without a process group (one process), that it reads in one process
    ("The argument order of load has been changed", UserWarning, ("torch.distributed.checkpoint.logger",)),
    ("torch.distributed is disabled, unavailable or uninitialized, assuming the intent is to load in a single",
     UserWarning, ("torch.distributed.checkpoint.utils",)),
    # megatron-core's distributed optimizer calls these torch collectives; torch names its successors
    ("`torch.distributed.all_gather_into_tensor` is deprecated", FutureWarning, ("torch.distributed.c10d_logger",)),
    ("`torch.distributed.reduce_scatter_tensor` is deprecated", FutureWarning, ("torch.distributed.c10d_logger",)),
)
# (logger, message start) for log records: filtered by a logging.Filter on that logger
LOG_RECORDS = (
    ("lm_eval.api.task", "Custom kwargs can be passed to `--metadata`"),
)


class _DropKnown(logging.Filter):
    def __init__(self, starts):
        super().__init__()
        self.starts = tuple(starts)

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.getMessage()).split(": ", 1)[-1].startswith(self.starts)


def quiet() -> bool:
    """Install the filters (once per process; idempotent). False, doing nothing, under MEGATRON_SAT_VERBOSE=1."""
    if os.environ.get("MEGATRON_SAT_VERBOSE"):
        return False
    entries = []
    for message, category, modules in WARNINGS:
        for module in modules:
            warnings.filterwarnings("ignore", message=re.escape(message), category=category,
                                    module=re.escape(module) + r"\Z")
            # -W's fields are split on ':' and PYTHONWARNINGS' entries on ',', and its message is matched as a
            # prefix: the message up to either character (a malformed entry costs every child a stderr line)
            entries.append(f"ignore:{re.split('[,:]', message)[0]}:{category.__name__}:{module}")
    # the processes this one spawns (the checkpoint writer, its queue's manager) import megatron-core afresh and
    # inherit the environment, not the filters
    known = os.environ.get("PYTHONWARNINGS", "")
    os.environ["PYTHONWARNINGS"] = ",".join([x for x in known.split(",") if x and x not in entries] + entries)
    by_logger = {}
    for name, start in LOG_RECORDS:
        by_logger.setdefault(name, []).append(start)
    for name, starts in by_logger.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropKnown) for f in logger.filters):
            logger.addFilter(_DropKnown(starts))
    return True
