"""How close is close enough: the measure the numeric tests compare tensors with, and the bounds docs/status.md states
for the conversions and for lm-eval, in one place. test_model_math.py::test_each_bound_fails_one_step_outside holds
every bound here at its edge through these very functions: 0.99 of a bound passes, 1.01 of it fails."""

EXPORT_LOGITS = 1e-4  # an HF export vs the Megatron model it came from, float32 (the tool's --verify bound too)
SAME_LOGITS = 1e-5  # the same weights in two implementations: transformers 4 vs 5, published shapes, RoPE scaling
LOSS = 1e-5  # a first training loss against transformers' own on the same batch (relative)
LOGLIKELIHOOD = dict(rel=1e-5, abs=1e-5)  # lm-eval's loglikelihoods vs direct forwards: pytest.approx takes the
#                                           larger, so absolute for a loglikelihood below 1 in size, relative above
ROLLING = dict(rel=1e-5)  # a rolling loglikelihood (a sum over a document: far from 0), and the HF backend's


def rel_max(got, want) -> float:
    """The largest difference over the reference's largest entry: one relative figure for a whole tensor that an
    entry near 0 cannot blow up."""
    return ((got - want).abs().max() / want.abs().max()).item()

