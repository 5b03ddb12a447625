"""GLM-4.6V whole (with GLM-4.5's MoE text model): GLM-4.5V whole's table, whose HF names
``Glm46VForConditionalGeneration`` holds alike (``model.visual.``, ``model.language_model.``,
``lm_head``)."""

from __future__ import annotations

from mmparity.models.glm4v_moe.mapping import SPEC  # noqa: F401
