"""ResFormer: layer 1's values V1 mixed into later layers as lambda1 V1 + lambda2 V ('learned': the SATFormer
authors' baseline, lambda1 = s softmax(logits) shared by the model, lambda2 per layer; 'fixed': 0.5 and 0.5)."""

from megatron_sat.archs.registry import register
from megatron_sat.archs.value_residual import ValueResidual, value_mix


class ResFormer(ValueResidual):
    name = "resformer"
    title = "ResFormer"
    colour = "#DD8452"
    hf_model_type = "ResFormer"
    hf_class = "ResFormer"
    # a fixed ResFormer stores no lambdas: these are HF-only there (the export writes lambda1 = 0.5, the import drops
    # them)
    hf_model_weights = (
        ("value_residual_lambdas.logits", "model.lambda_manager.lambda_logits", "L-1", "L-1", None, "all"),
        ("value_residual_lambdas.scale", "model.lambda_manager.lambda_scale", "1", "", None, "all"),
    )
    hf_layer_weights = (
        ("self_attention.value_residual_lambda2", "{attn}.value_residual_mixing.lambda2", "1", "", None, "mixing"),
    )

    upcycle_note = "lambda1 = 0 (scale 0, logits 0), lambda2 = 1: exactly the Transformer, every other weight its own"
    _STARTS = {"value_residual_lambdas.logits": 0.0, "value_residual_lambdas.scale": 0.0,
               "self_attention.value_residual_lambda2": 1.0}

    def upcycle_switch(self, field) -> bool:
        return field == "value_residual_last_k" or field.startswith("resformer_")

    def own_fields(self, model) -> tuple:
        return tuple(self._STARTS) if self.learned_lambdas(model) else ()

    def upcycle_errors(self, model, setting) -> list:
        if self.learned_lambdas(model):
            return []
        return [f"{setting('resformer_lambdas', 'fixed')} mixes 0.5 V1 + 0.5 V from the start, which is not the "
                f"Transformer's function: use {setting('resformer_lambdas', 'learned')} (it starts at lambda1 = 0, "
                "lambda2 = 1, the Transformer)"]

    def upcycle_start(self, name, std) -> tuple:
        """lambda1 = scale softmax(logits) = 0 and lambda2 = 1: V' = V, the Transformer's function; the scale's
        gradient is not 0 there, so lambda1 learns (the logits' follows once the scale moves)."""
        return ("constant", next(v for k, v in self._STARTS.items() if name.endswith(k)))

    def learned_lambdas(self, config) -> bool:
        return config.resformer_lambdas == "learned"

    def hf_only_weights(self, spec) -> bool:
        return spec.resformer_lambdas == "fixed"

    def layer_parameters(self, model, layer, tp, parts) -> bool:
        if self.learned_lambdas(model) and layer in self.mixing_layers(model):
            parts["value_residual"] = 1  # lambda2
        return False

    def chunk_parameters(self, model) -> int:
        return model.num_layers if self.learned_lambdas(model) else 0  # lambda1: L - 1 logits and a scale

    def flops(self, cfg, out, dims, tp) -> None:
        out["mixing"] = dims["m"] * 3 * dims["ng"] * dims["d"]  # l1 * V1, l2 * V, +

    def hf_config(self, spec, decoder, remote) -> dict:
        return dict(super().hf_config(spec, decoder, remote), value_residual_lambda2_init=0.5,
                    megatron_sat_resformer_lambdas=spec.resformer_lambdas)

    def hf_extra_fields(self, cfg, need) -> dict:
        return dict(super().hf_extra_fields(cfg, need),
                    resformer_lambdas=cfg.get("megatron_sat_resformer_lambdas", "learned"))

    def step_ops(self, model, layer, ctx):
        if layer not in model.mixing_layers:
            return ctx.layer()
        return ctx.layer(ops=[value_mix(model, ctx, "resformer lambda mix")])



ARCH = register(ResFormer())
