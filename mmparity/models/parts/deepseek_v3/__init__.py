"""The deepseek_v3 language-model part of whole VLMs: its record in the registry (the text model
types it takes); its modules sit beside this file."""

from mmparity.models.record import PartRecord

PART = PartRecord(
    summary="DeepSeek-V3 / Kimi-K2 decoder: multi-latent attention, leading dense layers, then "
            "routed experts with a shared expert (sigmoid, score-correction bias, group-limited "
            "top-k, scaling factor), YaRN RoPE; GPTModel with mcore's MLA and MoE layers",
    text_model_types=("deepseek_v3",),
    megatron="mmparity.models.parts.deepseek_v3.megatron:build_moe_language_model",
)
