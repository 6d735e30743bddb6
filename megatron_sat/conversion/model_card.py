"""The model card (README.md) of a Hugging Face export: what a reader of the folder needs to use and cite it.

    card = model_card(info, run_config, run_dir)    # export.py writes it as README.md

The metadata header is huggingface_hub's (ModelCardData: licence, library, tags, pipeline); the body names
the arch, shape and parameter count, the data and tokenizer, the tokens trained on (consumed samples x
sequence length at the exported iteration), the final validation loss (the last `val_loss` of the run's
metrics.jsonl at or before that iteration), the lm-eval scores found in RUN/eval/*/results.json
(tools/evaluate.py --checkpoint RUN --output RUN/eval/NAME), the licence (Apache-2.0) and the citation of
the SATFormer paper. Nothing here reads the weights.
"""

import glob
import json
import os
from typing import Optional

from huggingface_hub import ModelCardData

from megatron_sat import archs
from megatron_sat.training.records import read_metrics

PAPER_CITATION = """@article{gunasekaran2026satformer,
  title   = {Transformers with Selective Access to Early Representations},
  author  = {Gunasekaran and Wright and Zhu and Eshraghian},
  journal = {arXiv preprint arXiv:2605.03953},
  year    = {2026}
}"""
TRANSFORMERS_RANGE = ">= 4.51"  # Qwen3 (the Transformer baseline's class) first shipped in 4.51
ARCH_NAMES = {a: archs.get(a).title for a in archs.ARCHS}  # the arch modules' titles, for readers of this table


def _title(arch: str) -> str:
    """How the card names the arch: its module's title."""
    return archs.get(arch).title if archs.known(arch) else arch


def final_validation_loss(run_dir: Optional[str], iteration: Optional[int]):
    """(step, val_loss) of the last validation at or before `iteration` in run_dir/metrics.jsonl, or None."""
    last = None
    for row in read_metrics(run_dir) if run_dir else []:
        if "val_loss" in row and (iteration is None or row["step"] <= iteration):
            last = (row["step"], row["val_loss"])
    return last


def eval_scores(run_dir: Optional[str]) -> list:
    """[(suite folder, task, metric, value)] from run_dir/eval/*/results.json (tools/evaluate.py's output)."""
    rows = []
    for path in sorted(glob.glob(os.path.join(run_dir, "eval", "*", "results.json"))) if run_dir else []:
        try:
            with open(path) as f:
                table = json.load(f).get("table") or []
        except (OSError, ValueError):
            continue
        rows += [(os.path.basename(os.path.dirname(path)), r["task"], r["metric"], r["value"]) for r in table
                 if isinstance(r.get("value"), (int, float))]
    return rows


def public_name(value):
    """What a published card or record may say of a path: a local file or folder (or a data prefix, whose .bin/.idx
    exist) by its name alone, not where it lay on the machine that converted; a hub name ("org/model"), a blend's
    weights and anything else unchanged, token by token."""
    if not isinstance(value, str):
        return value

    def one(token: str) -> str:
        local = (os.path.isabs(token) or token.startswith(("./", "../", "~"))
                 or any(os.path.exists(token + end) for end in ("", ".bin", ".idx")))
        return os.path.basename(os.path.normpath(token)) if local and os.sep in token else token

    return " ".join(one(t) for t in value.split())


def model_card(info: dict, run_config: dict, run_dir: Optional[str], consumed_samples: Optional[int]) -> str:
    """README.md text for the export described by `info` (export.py's summary)."""
    spec, arch = info.get("spec") or {}, info["arch"]
    seq = run_config.get("seq_length") or spec.get("max_position_embeddings")
    tokens = consumed_samples * seq if consumed_samples is not None and seq else None
    val = final_validation_loss(run_dir, info.get("iteration"))
    identity = run_config.get("data_identity") or {}
    data = identity.get("data") or run_config.get("data") or "not recorded"
    if isinstance(data, dict):
        data = ", ".join(f"{k}: {public_name(v)}" for k, v in data.items() if v)
    else:
        data = public_name(data)
    meta = ModelCardData(license="apache-2.0", library_name="transformers", pipeline_tag="text-generation",
                         tags=["megatron-sat", arch, *(archs.get(arch).tags or (arch,))])
    shape = (f"{spec.get('num_layers')} layers, hidden size {spec.get('hidden_size')}, "
             f"{spec.get('num_attention_heads')} attention heads ({spec.get('num_query_groups')} KV heads), "
             f"FFN {spec.get('ffn_hidden_size')}, vocabulary {spec.get('vocab_size')}, context {seq}")
    lines = [
        "---", meta.to_yaml(), "---", "",
        f"# {_title(arch)} ({info['parameters']:,} parameters)", "",
        f"A {_title(arch)} language model trained with megatron-sat (Megatron-Core) and exported to "
        "Hugging Face format (load with `trust_remote_code=True`).", "",
        "| | |", "|---|---|",
        f"| arch | `{arch}` |",
        f"| shape | {shape} |",
        f"| parameters | {info['parameters']:,} |",
        f"| weights | {info.get('dtype')}, from iteration {info.get('iteration')} (`{info.get('source')}`) |",
        f"| data | {data} |",
        f"| tokenizer | {public_name(info.get('tokenizer') or run_config.get('tokenizer')) or 'not recorded'} |",
        f"| tokens trained | {'not recorded' if tokens is None else f'{tokens:,}'} |",
        f"| final validation loss | {'not recorded' if val is None else f'{val[1]:.4f} (step {val[0]})'} |",
        f"| recipe | {run_config.get('recipe') or 'none (flags)'} |",
        "",
    ]
    scores = eval_scores(run_dir)
    if scores:
        lines += ["## Evaluation (lm-eval)", "", "| suite | task | metric | value |", "|---|---|---|---:|"]
        lines += [f"| {s} | {t} | {m} | {v:.4f} |" for s, t, m, v in scores]
        lines.append("")
    lines += ["## Usage", "", "```python", "from transformers import AutoModelForCausalLM, AutoTokenizer", "",
              'model = AutoModelForCausalLM.from_pretrained("THIS_FOLDER", trust_remote_code=True)',
              'tokenizer = AutoTokenizer.from_pretrained("THIS_FOLDER", trust_remote_code=True)', "```", "",
              f"Loads in transformers {TRANSFORMERS_RANGE}, 4.x and 5.x alike (model, modeling code and tokenizer; "
              "checked on 4.57.1 and 5.24).", "",
              "## Licence", "", "Apache-2.0.", "",
              "## Citation", "", "The architecture is from arXiv 2605.03953:", "", "```bibtex", PAPER_CITATION, "```",
              ""]
    return "\n".join(lines)
