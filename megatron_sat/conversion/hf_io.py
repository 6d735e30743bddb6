"""Reading and writing Hugging Face model folders (no megatron import).

write_hf_folder writes everything into a sibling folder `OUTPUT.partial-<pid>` and renames it to
OUTPUT only when complete, so a crash never leaves a half-written export under OUTPUT. An existing
OUTPUT is replaced only with overwrite=True (moved aside first, deleted after the rename).
"""

import json
import os
import shutil
from pathlib import Path
from typing import Dict, Optional

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import GenerationConfig

from megatron_sat import archs
from megatron_sat.conversion.mapping import ConversionError, ModelSpec

HF_CODE = Path(__file__).parent / "hf_code"
INDEX = "model.safetensors.index.json"
DEFAULT_SHARD_BYTES = 5 * 1024**3


def read_hf_config(hf_dir: str) -> dict:
    path = Path(hf_dir) / "config.json"
    if not Path(hf_dir).is_dir():
        raise ConversionError(f"{hf_dir} is not a folder")
    if not path.is_file():
        raise ConversionError(f"{hf_dir} has no config.json: not a Hugging Face model folder")
    try:
        with open(path) as f:
            return json.load(f)
    except ValueError as e:
        raise ConversionError(f"{path} is not valid JSON ({e}): re-export the model or repair the file") from None


def read_hf_weights(hf_dir: str) -> Dict[str, torch.Tensor]:
    """All tensors of model.safetensors or of the shards named by model.safetensors.index.json."""
    root = Path(hf_dir)
    if (root / INDEX).is_file():
        with open(root / INDEX) as f:
            weight_map = json.load(f)["weight_map"]
        files = sorted(set(weight_map.values()))
        missing = [name for name in files if not (root / name).is_file()]
        if missing:
            raise ConversionError(f"{hf_dir}: shard(s) {', '.join(missing)} named in {INDEX} are missing")
    elif (root / "model.safetensors").is_file():
        files, weight_map = ["model.safetensors"], None
    else:
        bins = [p.name for p in root.glob("pytorch_model*.bin")]
        hint = " (only PyTorch .bin files: re-save with safe_serialization=True)" if bins else ""
        raise ConversionError(f"{hf_dir} has no model.safetensors or {INDEX}{hint}")
    state = {}
    for name in files:
        try:
            with safe_open(str(root / name), framework="pt") as f:
                for key in f.keys():
                    state[key] = f.get_tensor(key)
        except Exception as e:  # noqa: BLE001 (safetensors raises its own error types)
            raise ConversionError(f"{root / name} is unreadable ({type(e).__name__}: {e}): the file is truncated "
                                  "or damaged; copy or export it again") from None
    if weight_map is not None:
        absent = sorted(k for k in weight_map if k not in state)
        if absent:
            raise ConversionError(f"{hf_dir}: tensors {', '.join(absent[:5])} are in {INDEX} but in no shard")
    return state


def save_safetensors(state: Dict[str, torch.Tensor], folder: Path, max_shard_bytes: int) -> None:
    """model.safetensors, or model-0000i-of-0000n.safetensors + index when larger than max_shard_bytes."""
    shards, current, size = [], {}, 0
    for key in sorted(state):
        nbytes = state[key].numel() * state[key].element_size()
        if current and size + nbytes > max_shard_bytes:
            shards.append(current)
            current, size = {}, 0
        current[key] = state[key]
        size += nbytes
    shards.append(current)
    if len(shards) == 1:
        save_file(shards[0], str(folder / "model.safetensors"), metadata={"format": "pt"})
        return
    weight_map = {}
    for i, shard in enumerate(shards, 1):
        name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(folder / name), metadata={"format": "pt"})
        weight_map.update({k: name for k in shard})
    total = sum(t.numel() * t.element_size() for t in state.values())
    with open(folder / INDEX, "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2, sort_keys=True)


def write_remote_code(spec: ModelSpec, folder: Path) -> None:
    """The remote code the arch's module names (Arch.hf_code: configuration_<arch>.py, modeling_<arch>.py and the
    shared layers.py; the Transformer with q/k norms: modeling_transformer.py, Qwen3 subclasses; without them,
    transformers' own LlamaForCausalLM: none)."""
    arch = archs.get(spec.arch)
    for source, target in arch.hf_code_for(spec):
        text = (HF_CODE / source.format(arch=spec.arch)).read_text()
        for old, new in arch.hf_code_rewrites:
            text = text.replace(old.format(arch=spec.arch), new.format(arch=spec.arch))
        (folder / target.format(arch=spec.arch)).write_text(text)


def readable_per_umask(folder: Path) -> None:
    """Give every file and folder under `folder` the mode a plain open()/mkdir() gets under the process umask
    (0644 / 0755 under umask 022): safetensors (0.8) writes its files 0600, unreadable by the group and others
    of a shared cluster."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(folder, 0o777 & ~umask)
    for root, dirs, files in os.walk(folder):
        for d in dirs:
            os.chmod(os.path.join(root, d), 0o777 & ~umask)
        for f in files:
            os.chmod(os.path.join(root, f), 0o666 & ~umask)


def portable_tokenizer_config(path: Path) -> None:
    """Make a tokenizer_config.json that transformers 5 wrote readable by transformers 4.x (>= 4.51) as well.

    Written by hand: transformers 5 names its fast tokenizer TokenizersBackend (4.x has no such class; both read
    PreTrainedTokenizerFast, an alias of it in 5) and writes extra special tokens as a list (4.x wants a dict of named
    tokens there and reads a list as additional_special_tokens, which 5 reads too). model_input_names drops
    token_type_ids, which 4.x's PreTrainedTokenizerFast adds and these models take no argument for."""
    if not path.is_file():
        return
    with open(path) as f:
        config = json.load(f)
    if config.get("tokenizer_class") in (None, "TokenizersBackend"):
        config["tokenizer_class"] = "PreTrainedTokenizerFast"
    if isinstance(config.get("extra_special_tokens"), list):
        config["additional_special_tokens"] = config.pop("extra_special_tokens")
    config.setdefault("model_input_names", ["input_ids", "attention_mask"])
    with open(path, "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)


def write_hf_folder(output: str, spec: ModelSpec, config: dict, weights: Dict[str, torch.Tensor],
                    tokenizer=None, extra_files: Optional[Dict[str, str]] = None, overwrite: bool = False,
                    max_shard_bytes: int = DEFAULT_SHARD_BYTES) -> str:
    """Write an HF folder atomically; returns its absolute path."""
    out = Path(output).resolve()
    if out.exists() and not overwrite and (not out.is_dir() or any(out.iterdir())):
        raise ConversionError(f"{out} already exists and is not empty (pass --overwrite to replace it)")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f"{out.name}.partial-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        with open(tmp / "config.json", "w") as f:
            json.dump(config, f, indent=2, sort_keys=True)
        write_remote_code(spec, tmp)
        save_safetensors(weights, tmp, max_shard_bytes)
        GenerationConfig(bos_token_id=config.get("bos_token_id"), eos_token_id=config.get("eos_token_id"),
                         pad_token_id=config.get("pad_token_id")).save_pretrained(str(tmp))
        if tokenizer is not None:
            tokenizer.save_pretrained(str(tmp))
            portable_tokenizer_config(tmp / "tokenizer_config.json")
        for name, text in (extra_files or {}).items():
            (tmp / name).write_text(text)
        readable_per_umask(tmp)
        old = None
        if out.exists():
            old = out.parent / f"{out.name}.old-{os.getpid()}"
            os.replace(out, old)
        os.replace(tmp, out)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return str(out)
