"""Worker for tests/test_upcycle.py: the HF route of a start from a Transformer, in one process.

    python tests/workers/upcycle.py RUN HF IMPORT [trainer flags...]
        export the Transformer run RUN to HF (convert-to-hf), import it (convert-from-hf) into IMPORT with the
        trainer flags given (--arch satformer: a SATFormer started from it)
    python tests/workers/upcycle.py RUN HF
        export RUN only (the test reads the learned weights from HF/model.safetensors)
"""

import sys

from megatron_sat.conversion import export_checkpoint, import_hf

if __name__ == "__main__":
    run, hf, *rest = sys.argv[1:]
    quiet = lambda *a, **k: None  # noqa: E731
    export_checkpoint(run, hf, no_tokenizer=True, log=quiet)
    if rest:
        imported, *flags = rest
        print(import_hf(hf, imported, flags, log=quiet))
