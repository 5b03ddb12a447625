"""The gemma4_text language-model part of whole VLMs: its record (the text model types it takes);
its modules sit beside this file."""

from mmparity.models.record import PartRecord

PART = PartRecord(
    summary="Gemma 4 decoder: sliding and full layers (full ones wider, proportional RoPE), q/k norms and a "
            "weightless v norm, unscaled attention, sandwich norms, a scalar per layer, scaled embeddings, "
            "soft-capped logits, keys as values on full layers, the MoE block beside the MLP (an MoELayer), E2B / "
            "E4B's per-layer inputs and layers sharing earlier layers' keys/values",
    text_model_types=("gemma4_text",),
    # Its full-attention layers are wider than its sliding ones: mcore keys the block's tensors
    # layer by layer in torch_dist (the native model's TransformerConfig sets it too).
    megatron_args=(("hetereogenous_dist_checkpoint", True),),
    why_no_megatron="megatron-core's GPT layer specs have no sandwich norms, value norm, per-layer scalar, "
                    "per-layer-type head widths or RoPE, nor sliding-window layers beside full ones",
)
