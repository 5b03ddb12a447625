"""A throwaway language-model part with routed experts: DeepSeek-V3's architecture under a text
model type of its own (``toy_moe``), as a new release of it would be. Its record, and its HF
classes registered with transformers here, when the registry imports the package: transformers
builds a whole VLM's text model from its config (``AutoModel``), and ``check --hf`` reads a
config.json naming ``toy_moe`` through ``AutoConfig`` before any of the part's modules load."""

from mmparity.models.record import PartRecord
from tests.models.throwaway.toy_moe.reference import register_with_transformers

PART = PartRecord(
    summary="a throwaway decoder with routed experts (DeepSeek-V3's architecture, a test's)",
    text_model_types=("toy_moe",),
    megatron="mmparity.models.parts.deepseek_v3.megatron:build_moe_language_model",
)

register_with_transformers()
