"""The glm46v family: GLM-4.6V whole with a GLM-4.5 MoE text model (its record in the registry: what
``mmparity list`` shows and which checkpoints detection gives it); its modules sit beside this file
and are GLM-4.5V whole's (``glm4v_moe``) under another HF class."""

from mmparity.models.record import FamilyRecord, Takes

FAMILY = FamilyRecord(
    summary="GLM-4.6V whole with a GLM-4.5 MoE text model: GLM-4.5V whole's tower and decoder under "
            "Glm46VForConditionalGeneration (the dense GLM-4 text model is refused by name); logits, "
            "per-token loss, router agreement",
    reference_classes=("Glm46VForConditionalGeneration",),
    compared=("vision layers", "merger", "attention", "router", "routed experts", "shared experts",
              "language layers", "final_norm"),
    checkpoint_note="whole Glm46VForConditionalGeneration checkpoint with a glm4v_moe_text text config "
                    "(model.visual.*, model.language_model.*, lm_head) as Megatron's LLaVAModel tree, as "
                    "GLM-4.5V whole's",
    takes_whole=(Takes(architecture="Glm46VForConditionalGeneration"), Takes(model_type="glm46v")),
    with_language=True,
)
