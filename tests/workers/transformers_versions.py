"""What an export computes under one transformers version: tests/test_conversion.py runs it in-process (the venv's
transformers 5) and as a script with transformers 4.x first on sys.path (make venv installs it in .venv/transformers4).

    python tests/workers/transformers_versions.py T4_DIR OUT.pt HF_DIR [HF_DIR ...]

For each folder: the tokenizer (AutoTokenizer) and the model (AutoModelForCausalLM, trust_remote_code) loaded as a
user loads them, the token ids of a text, the float32 logits of fixed tokens and greedy tokens. Imports only torch
and transformers (no megatron_sat), so the version on sys.path is the one measured.
"""

import sys

TEXT = "w1 w2 w3 w40 w125"
PROMPT = [[3, 4, 5, 6, 7, 8, 9], [17, 3, 100, 42, 8, 64, 5]]


def measure(folders) -> dict:
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = {"version": transformers.__version__, "file": transformers.__file__}
    prompt = torch.tensor(PROMPT)
    for folder in folders:
        tok = AutoTokenizer.from_pretrained(folder, trust_remote_code=True)
        model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, dtype=torch.float32).eval()
        with torch.no_grad():
            logits = model(prompt).logits.float()
            greedy = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=8, do_sample=False,
                                    pad_token_id=0, eos_token_id=None)
        out[folder] = dict(ids=tok(TEXT)["input_ids"], keys=sorted(tok(TEXT)), eos=tok.eos_token_id,
                           tokenizer=type(tok).__name__, model=type(model).__name__, logits=logits, greedy=greedy)
    return out


if __name__ == "__main__":
    sys.path.insert(0, sys.argv[1])  # transformers 4.x (and its tokenizers, huggingface-hub) before the venv's
    import torch

    torch.set_num_threads(1)
    torch.save(measure(sys.argv[3:]), sys.argv[2])
