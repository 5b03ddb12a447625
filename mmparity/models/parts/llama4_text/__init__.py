"""The llama4_text language-model part of whole VLMs: its record (the text model types it takes);
its modules sit beside this file."""

from mmparity.models.record import PartRecord, lazy

PART = PartRecord(
    summary="Llama 4 decoder: GQA with RoPE layers (chunked attention, weightless q/k L2 norms) and NoPE "
            "layers (attention temperature tuning), dense MLP and sigmoid top-1 MoE layers (the score "
            "scales the expert input, a shared expert beside); GPTModel with per-layer specs",
    text_model_types=("llama4_text",),
    # Its router: sigmoid scores (no expert bias to tell it by), the score scaling the expert input;
    megatron_args=(("moe_router_score_function", "sigmoid"), ("moe_apply_probs_on_input", True),
                   # transformers rotates adjacent pairs: Megatron-LM's --rotary-interleaved.
                   ("rotary_interleaved", True)),
    # Its NoPE layers, q/k L2 norms and --spec, read off each config.
    megatron_config_args=lazy("mmparity.models.parts.llama4_text.config:megatron_args"),
    megatron="mmparity.models.parts.llama4_text.megatron:build_language_model",
)
