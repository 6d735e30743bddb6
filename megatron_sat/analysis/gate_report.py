"""Where SATFormer's gates open, on a Hugging Face export: per layer and head, per token, and ablations.

    python tools/analyze_gates.py --model hf/satformer --data held_out.jsonl --output gates/satformer

The export (tools/convert_to_hf.py) runs in evaluation mode on a text sample cut into sequences.
Forward hooks on its mixing modules read alpha = gate(x W_alpha) [b, s, N_kv] at every mixing
layer (the model itself is not changed) and gather:

  layers     the mean gate and the fraction of gates exactly 0, per layer and per KV head; the
             paper finds them sparse, mostly near 0 in early and middle layers
  tokens     the mean gate of each token (over mixing layers and heads): the most and least gated
             tokens, and function words and punctuation against the rest; the paper finds the gates
             favour semantic tokens
  ablations  perplexity with the gates as they are, set to 0 (V' = V, no value residual) and
             replaced by their per-layer, per-head mean over the sample; the paper finds that
             both raise perplexity

Without --data, the held-out tail of the embedded corpus (megatron_sat/data/corpus.py) is used.
Outputs in --output: report.json (everything), layers.csv, tokens.csv, heatmap.png (mean gate,
layer x head) and report.md, which is also printed.
"""

import csv
import json
import math
import os
import sys
from typing import Dict, List, Optional, Sequence

import torch
import torch.nn.functional as F
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from megatron_sat.data.corpus import default_corpus_documents
from megatron_sat.data.encode import iter_documents
from megatron_sat.data.readers import expand_inputs

# Function words (English): a token counts as one when, stripped of its tokenizer's space marker
# and lowercased, it is one of these or has no letter or digit (punctuation, whitespace).
FUNCTION_WORDS = frozenset("""
a an the this that these those there here it its it's i me my we us our you your he him his she her they them
their what which who whom whose when where why how and or but nor so yet if then else than as of at by for from
in into on onto to with without within about above below over under up down out off again further once all any
both each few more most other some such no not only own same too very can will just should would could may might
must shall do does did done doing be is am are was were been being have has had having s t ll re ve d m
""".split())


class GateReportError(ValueError):
    pass


def load_export(model_dir: str, device: str = "cpu", dtype: str = "float32"):
    """(model, tokenizer, mixing modules by 0-based layer, the export's gate function)."""
    if not os.path.isfile(os.path.join(model_dir, "config.json")):
        raise GateReportError(f"{model_dir} is not a Hugging Face model folder (no config.json)")
    config = AutoConfig.from_pretrained(model_dir, trust_remote_code=True)
    if config.model_type != "SATFormer":
        raise GateReportError(f"{model_dir} holds a {config.model_type} model; gate analysis needs a SATFormer "
                              "export (alpha = gate(x W_alpha) exists only there)")
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=True)
    except Exception as e:  # an export of a run that recorded no tokenizer
        raise GateReportError(f"{model_dir} has no tokenizer ({e.__class__.__name__}); export a run that "
                              "recorded one") from e
    model = AutoModelForCausalLM.from_pretrained(model_dir, trust_remote_code=True,
                                                 dtype=getattr(torch, dtype)).to(device).eval()
    mixing = {i: layer.attn.value_residual_mixing for i, layer in enumerate(model.model.layers)
              if getattr(layer.attn, "value_residual_mixing", None) is not None}
    if not mixing:
        raise GateReportError(f"{model_dir}: no layer mixes V1 (use_value_residual is off)")
    gate_fn = sys.modules[type(next(iter(mixing.values()))).__module__]._gate  # the export's own gate code
    return model, tokenizer, mixing, gate_fn


def default_documents(fraction: float = 0.05) -> List[str]:
    """The held-out tail of the embedded corpus (the part the demo run validates on)."""
    docs = [text for _, text in default_corpus_documents()]
    return docs[-max(1, int(len(docs) * fraction)):]


def read_documents(paths: Sequence[str], text_key: str = "text") -> List[str]:
    try:
        return [doc for path in expand_inputs(paths) for doc in iter_documents(path, json_key=text_key)]
    except (OSError, ValueError) as e:
        raise GateReportError(str(e)) from e


def make_sequences(documents: Sequence[str], tokenizer, seq_length: int, max_sequences: int) -> torch.Tensor:
    """Documents tokenized, joined with EOS and cut into [n, seq_length] (the remainder is dropped)."""
    eos = tokenizer.eos_token_id
    ids: List[int] = []
    for doc in documents:
        ids += tokenizer(doc, add_special_tokens=False, verbose=False)["input_ids"] + ([eos] if eos is not None else [])
        if len(ids) >= seq_length * max_sequences:
            break
    n = min(len(ids) // seq_length, max_sequences)
    if n == 0:
        raise GateReportError(f"the text gives {len(ids)} tokens, fewer than one sequence of {seq_length}")
    return torch.tensor(ids[: n * seq_length]).view(n, seq_length)


class GateProbe:
    """Forward hooks on the mixing modules: record the gates, or override them (mode 'zero' / 'mean')."""

    def __init__(self, mixing: Dict[int, torch.nn.Module], gate_fn, vocab_size: int):
        self.layers = sorted(mixing)
        self.gate_fn, self.mode, self.means = gate_fn, "record", None
        heads = mixing[self.layers[0]].alpha_proj.out_features
        self.sum = torch.zeros(len(self.layers), heads, dtype=torch.float64)  # [L, N_kv]
        self.zeros = torch.zeros(len(self.layers), heads, dtype=torch.float64)
        self.token_sum = torch.zeros(vocab_size, dtype=torch.float64)
        self.token_count = torch.zeros(vocab_size, dtype=torch.float64)
        self.ids: Optional[torch.Tensor] = None  # the batch being run [b, s]
        self._batch_gate = None  # sum over layers of the head-mean gate [b, s]
        self.handles = [mixing[i].register_forward_hook(self._hook(j)) for j, i in enumerate(self.layers)]

    def _hook(self, j: int):
        def hook(module, inputs, output):
            v, v1, x = inputs[:3]  # v, v1 [b, s, N_kv, d]; x [b, s, h]
            if self.mode == "zero":
                return v
            if self.mode == "mean":
                return v + self.means[j].to(v.device, v.dtype)[None, None, :, None] * v1
            alpha = self.gate_fn(module.gate, module.alpha_proj(x)).double().cpu()  # [b, s, N_kv]
            self.sum[j] += alpha.sum((0, 1))
            self.zeros[j] += (alpha == 0).sum((0, 1))
            head_mean = alpha.mean(-1)  # [b, s]
            self._batch_gate = head_mean if self._batch_gate is None else self._batch_gate + head_mean
            if j == len(self.layers) - 1:
                ids = self.ids.flatten().cpu()
                self.token_sum.index_add_(0, ids, (self._batch_gate / len(self.layers)).flatten())
                self.token_count.index_add_(0, ids, torch.ones_like(ids, dtype=torch.float64))
                self._batch_gate = None
            return None
        return hook

    def mean(self) -> torch.Tensor:
        return self.sum / self.token_count.sum()  # [L, N_kv]; every layer and head sees every token

    def zero_fraction(self) -> torch.Tensor:
        return self.zeros / self.token_count.sum()

    def remove(self):
        for h in self.handles:
            h.remove()


@torch.no_grad()
def negative_log_likelihood(model, sequences: torch.Tensor, batch_size: int, probe: GateProbe, device) -> float:
    """Mean next-token NLL over all sequences (every position but the first is predicted)."""
    total, count = 0.0, 0
    for start in range(0, len(sequences), batch_size):
        ids = sequences[start:start + batch_size].to(device)
        probe.ids = ids
        logits = model(input_ids=ids, use_cache=False).logits.float()
        total += F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten(), reduction="sum").item()
        count += ids[:, 1:].numel()
    return total / count


def is_function_token(text: str) -> bool:
    word = text.replace("\u0120", " ").replace("\u2581", " ").strip().lower()
    return word in FUNCTION_WORDS or not any(c.isalnum() for c in word)


def analyze(model_dir: str, documents: Optional[Sequence[str]] = None, *, seq_length: Optional[int] = None,
            max_sequences: int = 64, batch_size: int = 4, device: str = "cpu", dtype: str = "float32",
            ablations: bool = True, min_count: int = 5, top: int = 20, log=print) -> dict:
    """The whole report as a dict (see the module docstring)."""
    model, tokenizer, mixing, gate_fn = load_export(model_dir, device, dtype)
    seq_length = seq_length or min(1024, model.config.max_position_embeddings)
    if documents is None:
        documents = default_documents()
    sequences = make_sequences(documents, tokenizer, seq_length, max_sequences)
    probe = GateProbe(mixing, gate_fn, model.config.vocab_size)
    log(f"gate analysis: {model_dir}, {len(mixing)} mixing layers x {probe.sum.shape[1]} KV heads, "
        f"{sequences.shape[0]} sequences x {seq_length} tokens")
    nll = {"gates": negative_log_likelihood(model, sequences, batch_size, probe, device)}
    mean, zero = probe.mean(), probe.zero_fraction()
    if ablations:
        probe.means = mean.float()
        for mode in ("zero", "mean"):
            probe.mode = mode
            nll[mode] = negative_log_likelihood(model, sequences, batch_size, probe, device)
            log(f"  perplexity with gates {mode}: {math.exp(nll[mode]):.3f} (as trained: {math.exp(nll['gates']):.3f})")
    probe.remove()

    text = {i: tokenizer.decode([i]) for i in probe.token_count.nonzero().flatten().tolist()}  # tokens seen
    rows = sorted(({"id": i, "token": t, "count": int(probe.token_count[i]),
                    "mean_gate": float(probe.token_sum[i] / probe.token_count[i])}
                   for i, t in text.items() if probe.token_count[i] >= min_count), key=lambda r: -r["mean_gate"])
    classes = {}
    for name, pick in (("function", True), ("content", False)):
        members = [i for i, t in text.items() if is_function_token(t) == pick]
        n = float(probe.token_count[members].sum()) if members else 0.0
        classes[name] = {"tokens": int(n), "mean_gate": float(probe.token_sum[members].sum()) / n if n else None}
    layers = [{"layer": i + 1, "head": h, "mean_gate": float(mean[j, h]), "zero_fraction": float(zero[j, h])}
              for j, i in enumerate(probe.layers) for h in range(mean.shape[1])]
    return {
        "model": os.path.abspath(model_dir), "gate": next(iter(mixing.values())).gate,
        "sequences": int(sequences.shape[0]), "seq_length": int(seq_length), "tokens": int(sequences.numel()),
        "mixing_layers": [i + 1 for i in probe.layers],
        "per_layer": [{"layer": i + 1, "mean_gate": float(mean[j].mean()), "zero_fraction": float(zero[j].mean())}
                      for j, i in enumerate(probe.layers)],
        "per_head": layers,
        "token_classes": classes,
        "most_gated_tokens": rows[:top], "least_gated_tokens": rows[::-1][:top], "all_tokens": rows,
        "nll": nll, "perplexity": {k: math.exp(v) for k, v in nll.items()},
    }


def to_markdown(report: dict) -> str:
    lines = [f"# Gate analysis: {report['model']}", "",
             f"{report['gate']} gate, {report['sequences']} sequences x {report['seq_length']} tokens.", "",
             "| layer | mean gate | zero fraction |", "|---:|---:|---:|"]
    lines += [f"| {r['layer']} | {r['mean_gate']:.4f} | {r['zero_fraction']:.3f} |" for r in report["per_layer"]]
    classes = report["token_classes"]
    lines += ["", "| tokens | count | mean gate |", "|---|---:|---:|"]
    for name, c in classes.items():
        value = "" if c["mean_gate"] is None else f"{c['mean_gate']:.4f}"
        lines.append(f"| {name} | {c['tokens']} | {value} |")
    for title, key in (("Most gated", "most_gated_tokens"), ("Least gated", "least_gated_tokens")):
        shown = ", ".join(f"`{r['token'].strip() or repr(r['token'])}` {r['mean_gate']:.3f}" for r in report[key][:10])
        lines += ["", f"{title} tokens: {shown or '(none seen often enough)'}"]
    if len(report["perplexity"]) > 1:
        base = report["perplexity"]["gates"]
        lines += ["", "| gates | perplexity | ratio |", "|---|---:|---:|"]
        names = {"gates": "as trained", "zero": "set to 0", "mean": "per-head mean"}
        lines += [f"| {names[k]} | {v:.3f} | {v / base:.3f} |" for k, v in report["perplexity"].items()]
    return "\n".join(lines) + "\n"


def write_report(report: dict, output: str) -> List[str]:
    """report.json, layers.csv, tokens.csv, heatmap.png and report.md in `output`; returns their paths."""
    os.makedirs(output, exist_ok=True)
    paths = [os.path.join(output, n) for n in ("report.json", "layers.csv", "tokens.csv", "heatmap.png", "report.md")]
    with open(paths[0], "w") as f:
        json.dump(report, f, indent=1)
    for path, rows in ((paths[1], report["per_head"]), (paths[2], report["all_tokens"])):
        with open(path, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]) if rows else ["id"])
            writer.writeheader()
            writer.writerows(rows)
    _heatmap(report, paths[3])
    with open(paths[4], "w") as f:
        f.write(to_markdown(report))
    return paths


def _heatmap(report: dict, path: str) -> None:
    # matplotlib: optional (eval extra), and its Agg backend is chosen here, not for every importer of this module
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # after matplotlib.use

    layers = report["mixing_layers"]
    heads = 1 + max(r["head"] for r in report["per_head"])
    grid = torch.tensor([r["mean_gate"] for r in report["per_head"]]).view(len(layers), heads)
    fig, ax = plt.subplots(figsize=(max(4, heads * 0.35 + 2), max(3, len(layers) * 0.3 + 1.5)))
    image = ax.imshow(grid.numpy(), aspect="auto", cmap="viridis", origin="lower")
    ax.set_yticks(range(len(layers)), [str(n) for n in layers])
    ax.set_xlabel("KV head")
    ax.set_ylabel("layer")
    ax.set_title("mean gate")
    fig.colorbar(image, ax=ax)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
