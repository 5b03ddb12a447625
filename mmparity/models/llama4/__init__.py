"""The llama4 family: its record in the registry (what ``mmparity list`` shows and which
checkpoints detection gives it); its modules sit beside this file."""

from mmparity.models.record import FamilyRecord, Takes

FAMILY = FamilyRecord(
    summary="Llama 4 whole: the llama4_vision tower (pixel shuffle + adapter), the projector linear, the "
            "Llama 4 decoder (RoPE / NoPE layers, chunked attention, sigmoid top-1 MoE with a shared "
            "expert); images as tiles; logits, per-token loss, router agreement",
    reference_classes=("Llama4ForConditionalGeneration",),
    compared=("vision layers", "adapter", "vision_projection", "attention", "router", "shared_experts",
              "routed experts", "language layers", "final_norm"),
    checkpoint_note="whole Llama4ForConditionalGeneration checkpoint as Megatron's LLaVAModel tree "
                    "(vision_model, vision_projection, language_model with MoE layers); the experts' "
                    "stacks read and written as saved ([E, H, 2I] and [E, I, H]), named as "
                    "TEGroupedMLP names them",
    takes_whole=(Takes(architecture="Llama4ForConditionalGeneration", text_model_type="llama4_text"),
                 Takes(model_type="llama4", text_model_type="llama4_text")),
    with_language=True,
    # transformers runs a layer's experts as one batched matmul over the whole stacks, which the
    # low-memory path's expert-by-expert reading cannot serve.
    low_memory=False,
)
