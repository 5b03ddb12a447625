"""The gemma4 family: Gemma 4 whole (its record in the registry: what ``mmparity list`` shows and
which checkpoints detection gives it); its modules sit beside this file."""

from mmparity.models.record import FamilyRecord, Takes

FAMILY = FamilyRecord(
    summary="Gemma 4 whole: the gemma4_vision tower (images of any size, pooled), the multimodal embedder "
            "(weightless RMSNorm + linear), the gemma4_text decoder (sliding and wider full layers, value norm, "
            "layer scalars, E2B / E4B's per-layer inputs and shared keys/values, soft-capped logits, tied head); images attend within themselves both ways on "
            "sliding layers; audio left out; logits and per-token loss",
    reference_classes=("Gemma4ForConditionalGeneration",),
    compared=("vision layers", "vision_projection", "language layers (norms, attention, mlp)", "final_layernorm"),
    checkpoint_note="whole Gemma4ForConditionalGeneration checkpoint as Megatron's LLaVAModel tree (vision_model, "
                    "vision_projection, language_model in Megatron-Bridge's Gemma 3 names, layer scalars beside); "
                    "the audio tower and embedder dropped and counted; vocabulary padded as Megatron-LM pads it",
    takes_whole=(Takes(architecture="Gemma4ForConditionalGeneration", text_model_type="gemma4_text"),
                 Takes(model_type="gemma4", text_model_type="gemma4_text")),
    with_language=True,
    # What a Megatron-LM run given --use-checkpoint-args builds its language model with: the
    # family's layer (its widths and RoPE read from the hf_config.json beside the checkpoint,
    # mmparity.models.gemma4.megatron) and no position embedding of the model's own (each layer
    # rotates with its own table), the gated MLP layout (the only gated one Megatron-LM's flags
    # name: --swiglu; the layer takes the tanh GeGLU from that file).
    megatron_args=(("spec", ["mmparity.models.gemma4.megatron", "LAYER"]), ("position_embedding_type", "none"),
                   ("swiglu", True)),
)
