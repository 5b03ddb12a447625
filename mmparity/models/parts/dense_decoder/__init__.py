"""The dense_decoder language-model part of whole VLMs: its record in the registry (the text model
types it takes); its modules sit beside this file."""

from mmparity.models.record import PartRecord

PART = PartRecord(
    summary="Llama / Mistral / Qwen2-style decoder (GQA, explicit head_dim, q/k/v biases as the "
            "model type has them, tied or untied head) as Megatron's GPTModel",
    text_model_types=("llama", "mistral", "qwen2"),
    megatron="mmparity.models.parts.dense_decoder.megatron:build_language_model",
)
