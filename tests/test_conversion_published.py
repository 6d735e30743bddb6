"""Official Qwen3 and Llama folders into the Transformer baseline and into SATFormer (convert-from-hf).

    pytest -q tests/test_conversion_published.py          # about 1 minute on 2 cores

Three launches (tests/workers/published.py): 1 rank makes tiny Qwen3ForCausalLM and LlamaForCausalLM folders with
transformers' own config classes at official shape ratios (head dim 16 != hidden 48 / 4 heads, 2 KV heads, untied
embeddings, rope theta 5e5; Llama: no q/k norms, norm eps 1e-5), imports each as the Transformer and as a SATFormer
(--arch satformer) and exports both back; 4 ranks train the Transformer imports and Qwen3's SATFormer 3 steps at
TP2 x PP2; 1 rank exports the trained checkpoints and each of the six archs at a published shape. Real
transformers models throughout, no mocks. Tolerances: the round trip is bit-identical; Megatron vs transformers
logits relative max 1e-5 (fp32); the first TP2 x PP2 loss vs transformers' own loss on the same batch relative 1e-5.
"""

import json
import os
import sys

import pytest
import torch
import torch.nn.functional as F
from closeness import LOSS, SAME_LOGITS, rel_max
from dist_utils import run_distributed
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from megatron_sat.conversion import ConversionError, import_hf

pytestmark = pytest.mark.slow  # trainer parts, imports and exports in subprocesses

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "workers", "published.py")
sys.path.insert(0, os.path.join(HERE, "workers"))
from published import SEQ, SOURCES, VOCAB, tokens  # noqa: E402


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("published"))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models: one thread is as fast on a busy 2-core machine
    try:
        reference = run_distributed(f"{WORKER}:imports", 1, root, timeout=900)[0]
        trained = run_distributed(f"{WORKER}:train", 4, root, timeout=900)
        exported = run_distributed(f"{WORKER}:exports", 1, root, timeout=900)[0]
        yield dict(root=root, reference=reference, trained=trained, exported=exported)
    finally:
        torch.set_num_threads(threads)


def _logits(folder):
    model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(tokens()).logits.float()


@pytest.mark.parametrize("name", SOURCES)
def test_import_round_trip_is_identical_and_logits_equal_transformers(built, name):
    d = os.path.join(built["root"], name)
    source, back = load_file(os.path.join(d, "hf", "model.safetensors")), load_file(os.path.join(d, "HF_T",
                                                                                                 "model.safetensors"))
    assert sorted(source) == sorted(back) and "lm_head.weight" in back  # untied: an output layer of its own
    assert all(torch.equal(source[k], back[k]) for k in source)
    cfg = json.load(open(os.path.join(d, "HF_T", "config.json")))
    want = "Qwen3ForCausalLM" if name == "qwen3" else "LlamaForCausalLM"  # Llama: transformers' own, no remote code
    assert cfg["architectures"] == [want] and ("auto_map" in cfg) == (name == "qwen3")
    assert (cfg["head_dim"], cfg["num_key_value_heads"], cfg["tie_word_embeddings"], cfg["rope_theta"],
            cfg["rms_norm_eps"]) == (16, 2, False, 500000.0, 1e-6 if name == "qwen3" else 1e-5)
    assert built["reference"][f"{name}/T"] <= SAME_LOGITS  # the imported Megatron model vs the export, in transformers
    # the import's recorded flag, which the trainer builds from (the weights alone round-trip with it inverted)
    assert json.load(open(os.path.join(d, "T", "config.json")))["untie_embeddings_and_output_weights"] is True
    assert rel_max(_logits(os.path.join(d, "HF_T")), built["reference"][name]) <= SAME_LOGITS


@pytest.mark.parametrize("name", SOURCES)
def test_satformer_from_the_transformer_equals_it_at_step_0(built, name):
    """--arch satformer: W_alpha zero with the relu gate, so V' = V and the logits are the source model's."""
    d = os.path.join(built["root"], name)
    cfg = json.load(open(os.path.join(d, "HF_S", "config.json")))
    assert cfg["architectures"] == ["SATFormerForCausalLM"] and cfg["value_residual_gate"] == "relu"
    assert (cfg["head_dim"], cfg["qk_norm"], cfg["tie_word_embeddings"]) == (16, name == "qwen3", False)
    weights = load_file(os.path.join(d, "HF_S", "model.safetensors"))
    gates = [v for k, v in weights.items() if k.endswith("alpha_proj.weight")]
    assert len(gates) == 3 and all(g.shape == (2, 48) and not g.any() for g in gates)  # layers 2..4 mix V1
    assert built["reference"][f"{name}/S"] <= SAME_LOGITS  # Megatron's SATFormer vs its export
    assert rel_max(_logits(os.path.join(d, "HF_S")), built["reference"][name]) <= SAME_LOGITS


@pytest.mark.parametrize("name", SOURCES)
def test_tp2_pp2_training_from_the_import(built, name):
    """The import trains at TP2 x PP2: its first loss is transformers' own on the same batch, the loss falls over
    3 steps, and the trained checkpoint exports to a model whose logits equal Megatron's."""
    d = os.path.join(built["root"], name)
    first = _trained(built, name, dict(arch="transformer", head_dim=16, qk_layernorm=name == "qwen3", untied=True,
                                       rotary_base=500000, fused_gate=False))
    theirs = _source_loss(d)
    assert abs(first - theirs) <= LOSS * theirs, (first, theirs)
    assert built["exported"][name] <= SAME_LOGITS
    trained = load_file(os.path.join(d, "HF_T3", "model.safetensors"))
    source = load_file(os.path.join(d, "hf", "model.safetensors"))
    assert not torch.equal(trained["lm_head.weight"], source["lm_head.weight"])


def test_satformer_from_qwen3_trains_at_tp2_pp2(built):
    """The SATFormer started from Qwen3, at TP2 x PP2 (its gate fused into linear_qkv, V1 [s, b, 2, 16] on the
    pipeline message next to hidden 48): its first loss is the source Transformer's, and it trains."""
    first = _trained(built, "qwen3/S", dict(arch="satformer", head_dim=16, qk_layernorm=True, untied=True,
                                            rotary_base=500000, fused_gate=True))
    theirs = _source_loss(os.path.join(built["root"], "qwen3"))
    assert abs(first - theirs) <= LOSS * theirs, (first, theirs)


def _trained(built, key, facts) -> float:
    """The first of the 3 losses of run `key` (equal on every rank that has it, falling), after checking `facts`."""
    runs = [r[key] for r in built["trained"]]
    losses = [r["losses"] for r in runs if r["losses"][0] is not None]
    assert losses and all(x == losses[0] for x in losses)
    first, *later = losses[0]
    assert later[0] < first and later[1] < later[0]
    assert all({k: r[k] for k in facts} == facts for r in runs)
    return first


def _source_loss(d) -> float:
    """transformers' own loss of the source folder on the worker's batch (tests/workers/conversion.py _step)."""
    model = AutoModelForCausalLM.from_pretrained(os.path.join(d, "hf"), dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(5)  # 2 micro-batches of 1 x (SEQ + 1) tokens
    data = torch.cat([torch.randint(0, VOCAB, (1, SEQ + 1), generator=g) for _ in range(2)])
    with torch.no_grad():
        logits = model(data[:, :-1]).logits
    return F.cross_entropy(logits.reshape(-1, VOCAB), data[:, 1:].reshape(-1)).item()


def test_every_arch_takes_a_published_shape(built):
    """All six archs build, export and load in transformers with a free head dim, GQA, untied embeddings, norm eps
    1e-5, with and without q/k norms (no arch refuses these: SATFormer's gate and V1 are per KV head)."""
    archs = built["exported"]["archs"]
    assert len(archs) == 12
    for case, (rel, round_trip) in archs.items():
        assert rel <= SAME_LOGITS and round_trip, (case, rel)


def test_import_refusals(built, tmp_path):
    """One line each, before any model is built."""
    hf = os.path.join(built["root"], "qwen3", "hf")
    quiet = lambda *a, **k: None  # noqa: E731

    def refuse(match, argv, folder=hf):
        with pytest.raises(ConversionError, match=match):
            import_hf(folder, str(tmp_path / "out"), argv, log=quiet)

    refuse("--resformer-lambdas fixed mixes 0.5 V1", ["--arch", "resformer", "--resformer-lambdas", "fixed"])
    refuse("--arch denseformer cannot start from a Transformer", ["--arch", "denseformer"])
    refuse("--value-residual-gate sigmoid is not 0 at 0", ["--arch", "satformer", "--value-residual-gate", "sigmoid"])
    refuse("do not pass --kv-channels", ["--kv-channels", "8"])
    refuse("do not pass --no-qk-layernorm", ["--no-qk-layernorm"])
    refuse("do not pass --untie-embeddings-and-output-weights", ["--untie-embeddings-and-output-weights"])
    refuse(r"only a Transformer .* can start another arch",
           ["--arch", "transformer"], folder=os.path.join(built["root"], "qwen3", "HF_S"))
    scaled = tmp_path / "llama3_1"
    scaled.mkdir()
    for f in os.listdir(os.path.join(built["root"], "llama", "hf")):
        os.symlink(os.path.join(built["root"], "llama", "hf", f), scaled / f)
    cfg = json.load(open(scaled / "config.json"))
    os.remove(scaled / "config.json")
    json.dump(dict(cfg, rope_scaling=dict(rope_type="llama3", factor=8.0)), open(scaled / "config.json", "w"))
    refuse("rope_type 'llama3'", [], folder=str(scaled))
    assert not os.path.exists(tmp_path / "out")


def test_rotary_buffers_of_older_llama_files_are_dropped():
    """Older Llama conversions store each layer's rotary_emb.inv_freq (a buffer RoPE recomputes): not a weight."""
    from megatron_sat.conversion.mapping import ModelSpec, hf_shapes, hf_to_megatron, megatron_shapes

    spec = ModelSpec(arch="transformer", num_layers=2, hidden_size=48, num_attention_heads=4, num_query_groups=2,
                     kv_channels=16, ffn_hidden_size=96, vocab_size=VOCAB, max_position_embeddings=SEQ, tied=False,
                     qk_layernorm=False)
    state = {k: torch.randn(s) for k, s in hf_shapes(spec).items()}
    state["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)
    assert {k: tuple(v.shape) for k, v in hf_to_megatron(state, spec).items()} == megatron_shapes(spec)
