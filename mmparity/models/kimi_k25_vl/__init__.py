"""The kimi_k25_vl family: its record in the registry (what ``mmparity list`` shows and which
checkpoints detection gives it); its modules sit beside this file."""

from mmparity.models.record import FamilyRecord, Takes

FAMILY = FamilyRecord(
    summary="Kimi-K2.5 whole: MoonViT + projector + DeepSeek-V3 decoder (MLA, leading dense "
            "layers, routed and shared experts); logits, per-token loss, router agreement",
    reference_classes=("Kimi_K25ForConditionalGeneration",),
    compared=("vision layers", "vision_projection", "attention", "router", "shared_experts",
              "routed experts", "language layers", "final_norm"),
    checkpoint_note="whole Kimi_K25ForConditionalGeneration checkpoint as Megatron's LLaVAModel "
                    "(vision_model, vision_projection, language_model with MoE layers); module "
                    "names, the release layout (language_model.model.layers.N, one tensor per "
                    "expert) or what transformers' save_pretrained writes (blocks.N, read through "
                    "its conversion mapping); experts as TEGroupedMLP names them; MTP layers "
                    "dropped and reported",
    takes_whole=(Takes(architecture="Kimi_K25ForConditionalGeneration", text_model_type="deepseek_v3"),
                 Takes(model_type="kimi_k25", text_model_type="deepseek_v3")),
    with_language=True,
)
