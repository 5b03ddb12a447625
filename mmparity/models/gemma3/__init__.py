"""The gemma3 family: Gemma 3 whole (its record in the registry: what ``mmparity list`` shows and
which checkpoints detection gives it); its modules sit beside this file."""

from mmparity.models.record import FamilyRecord, Takes, lazy

FAMILY = FamilyRecord(
    summary="Gemma 3 whole: the siglip tower, average-pool projector with a (1 + w) RMSNorm, Gemma "
            "decoder (sliding and global layers, q/k norms, sandwich norms, scaled embeddings, "
            "soft-capped logits, tied head); images attend within themselves both ways; logits and "
            "per-token loss",
    reference_classes=("Gemma3ForConditionalGeneration",),
    compared=("vision layers", "vision_projection", "language layers (norms, attention, mlp)", "final_layernorm"),
    checkpoint_note="whole Gemma3ForConditionalGeneration checkpoint as Megatron's LLaVAModel tree "
                    "(vision_model, vision_projection, language_model in Megatron-Bridge's Gemma 3 "
                    "names); vocabulary padded as Megatron-LM pads it",
    takes_whole=(Takes(architecture="Gemma3ForConditionalGeneration"), Takes(model_type="gemma3")),
    megatron_args=(("layernorm_zero_centered_gamma", True),),
    # Its windows and --spec, read off each config.
    megatron_config_args=lazy("mmparity.models.gemma3.config:megatron_args"),
)
