"""GLM-4.6V's HF configuration class as a table, so that config.json is read without transformers:
transformers 5's defaults of ``Glm46VConfig``, whose sub-configs are whatever model types they name
(the tower's and GLM-4.5V's text model's tables sit with the ``glm4v_vision`` and ``glm4v_moe``
families). Imports no framework."""

from __future__ import annotations

from mmparity.config import ConfigType
from mmparity.models.glm4v_vision.reference import DENSE_MODEL_TYPE

# The class's default text model: GLM-4.1V's dense one, which this family does not take.
DENSE_TEXT_MODEL_TYPE = "glm4v_text"



def _groups(v: dict, extra: dict) -> None:
    if v["num_key_value_heads"] is None:
        v["num_key_value_heads"] = v["num_attention_heads"]


HF_CONFIGS = {
    # Read so that a GLM-4.6V config naming it is refused by what it is, not as unreadable.
    DENSE_TEXT_MODEL_TYPE: ConfigType({"vocab_size": 151552, "hidden_size": 4096, "intermediate_size": 13696,
                                       "num_hidden_layers": 40, "num_attention_heads": 32, "num_key_value_heads": 2,
                                       "hidden_act": "silu", "max_position_embeddings": 32768,
                                       "initializer_range": 0.02, "rms_norm_eps": 1e-05, "use_cache": True,
                                       "attention_dropout": 0.0, "rope_parameters": None, "pad_token_id": None},
                                      rope_type="default", before=_groups),
    "glm46v": ConfigType({"text_config": None, "vision_config": None, "image_token_id": 151343,
                          "video_token_id": 151344, "image_start_token_id": 151339, "image_end_token_id": 151340,
                          "video_start_token_id": 151361, "video_end_token_id": 151362,
                          "tie_word_embeddings": False},
                         subs={"vision_config": (DENSE_MODEL_TYPE, True, {}),
                               "text_config": (DENSE_TEXT_MODEL_TYPE, True, {})}),
}
