"""Llama 3.1+ RoPE scaling (transformers' rope_type "llama3") with all four of its numbers.

Megatron-Core's RotaryEmbedding can scale its inverse frequencies the Llama 3.1 way, but with low, high and the
original context fixed at 1, 4 and 8192; Llama 3.2 (factor 32) and any other Llama 3.x config need them free. The
rule, per rotary frequency f with wavelength w = 2 pi / f and the original context C:

    w > C / low           (long wavelengths)   f / factor
    w < C / high          (short wavelengths)  f
    otherwise                                  (1 - s) f / factor + s f,   s = (C / w - low) / (high - low)

build_model (model/gpt.py) replaces the unscaled frequencies of every chunk's RotaryEmbedding with these.
"""

import math

import torch


def llama3_inv_freq(inv_freq: torch.Tensor, factor: float, low_freq_factor: float, high_freq_factor: float,
                    original_max_position_embeddings: int) -> torch.Tensor:
    """The scaled inverse frequencies of the unscaled `inv_freq` (any device, its dtype)."""
    context = original_max_position_embeddings
    wavelength = 2 * math.pi / inv_freq
    scaled = torch.where(wavelength > context / low_freq_factor, inv_freq / factor, inv_freq)
    smooth = (context / wavelength - low_freq_factor) / (high_freq_factor - low_freq_factor)
    between = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelength >= context / high_freq_factor) & (wavelength <= context / low_freq_factor)
    return torch.where(medium, between, scaled)


def scale_rotary(model, config) -> None:
    """Apply the config's RoPE scaling (ModelArgs.use_rope_scaling and its four values) to `model`'s rotary
    embedding, in place, before its first forward (RotaryEmbedding caches its output per sequence length)."""
    rotary = getattr(model, "rotary_pos_emb", None)
    if not config.use_rope_scaling or rotary is None:
        return
    rotary.inv_freq = llama3_inv_freq(rotary.inv_freq, config.rope_scaling_factor, config.rope_scaling_low_freq_factor,
                                      config.rope_scaling_high_freq_factor,
                                      config.rope_scaling_original_max_position_embeddings)
