"""Native LLaVA: vision tower -> projector -> placeholder expansion -> Llama-style GPT decoder.

The framework-free input handling (placeholder expansion, pixel shuffle, loss weights) lives in
:mod:`mmparity.models.llava.preprocess`; this module wires it to Megatron-Core modules, after
Megatron-LM ``megatron/core/models/multimodal/llava_model.py``. Deviations are listed on
:class:`LLaVAModel`.
"""

from __future__ import annotations

import contextlib
import copy
import functools
from typing import Callable, Optional, Sequence

import torch
from megatron.core import parallel_state, tensor_parallel
from megatron.core.models.vision.multimodal_projector import MultimodalProjector
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.mlp import MLPSubmodules
from megatron.core.transformer.module import MegatronModule

from mmparity.mapping.rules import VOCAB_MULTIPLE
from mmparity.parallel import runtime
from mmparity.config import (
    feature_layer_indices, padded_vocab_size, pixel_shuffle_reduction, select_strategy, tied_embeddings, tower_depth)
from mmparity.models.llava.config import projection_fields
from mmparity.models.llava.preprocess import DEFAULT_IMAGE_TOKEN_INDEX, _preprocess_data, pixel_shuffle
from mmparity.models.core.attention import make_packed_seq_params
from mmparity.models.core.stages import language_stage
from mmparity.models.core.layers import (
    NormedColumnParallelLinear, activation_from_hf, tolerate_missing_extra_state, vision_transformer_config)


def projection_transformer_config(cfg, params_dtype: torch.dtype = torch.float32):
    """HF ``LlavaMultiModalProjector``: Linear(vision·n -> text) -> act -> Linear(text -> text), the
    projector's recipe (:func:`~mmparity.models.llava.config.projection_fields`) with HF's own
    activation function."""
    fields = projection_fields(cfg)
    fields["activation"] = activation_from_hf(fields["activation"])
    # num_attention_heads only has to satisfy TransformerConfig's TP checks; the MLP has no heads.
    return vision_transformer_config(num_layers=1, num_attention_heads=cfg.text_config.num_attention_heads,
                                     params_dtype=params_dtype, pipelined_stack=False, **fields)


# The vocabulary tables a state dict may hold (the first stage has the embedding, the last the
# output layer; a tied model only the embedding).
_VOCABULARY_TABLES = ("language_model.embedding.word_embeddings.weight", "language_model.output_layer.weight")


def _take_the_checkpoints_vocabulary_padding(model: "LLaVAModel", state_dict, prefix: str, *_) -> None:
    """Load-time: a checkpoint padded its vocabulary with another ``make_vocab_size_divisible_by``
    than the 128 the model is built with (Megatron-LM's default; the divisor is the checkpoint's,
    recorded in its manifest): the language model is rebuilt with the checkpoint's padded size, so
    the tables load as they are. Only the padding may differ: fewer rows than the real
    vocabulary, or a size TP does not split, is left to the load to refuse."""
    tp = runtime.current_layout().tp
    for name in _VOCABULARY_TABLES:
        table = state_dict.get(prefix + name)
        if not torch.is_tensor(table) or table.dim() != 2:
            continue
        padded = table.shape[0] * tp
        if padded != model.language_model.vocab_size and padded >= model.vocab_size:
            device = next(model.language_model.parameters()).device
            with torch.device(device):
                model.language_model = model._build_language_model(padded)
        return


class LLaVAModel(MegatronModule):
    """LLaVA on mcore parts (after Megatron-LM ``megatron/core/models/multimodal/llava_model.py``): vision tower -> ``MultimodalProjector`` -> ``GPTModel``.

    Submodules and state-dict roots follow upstream's ``LLaVAModel``: ``language_model`` (a ``GPTModel`` with RoPE,
    Llama-style layers from :func:`language_layer_spec`), ``vision_model`` (a registered vision
    family's native tower) and ``vision_projection`` (``encoder.linear_fc1`` / ``linear_fc2``).

    Deliberate deviations from upstream:

    * The vision tower is passed in built (``vision_model``) rather than built here from a
      config and a spec: each vision family owns how its tower is put together. Likewise the
      language model comes from its part's ``language_model_builder`` (a ``GPTModel`` for the
      dense decoder), called with the padded vocabulary and this stage's pre/post process.
    * ``vision_feature_layers`` (HF ``vision_feature_layer``, resolved to ``hidden_states``
      indices; several are concatenated along features) select which vision hidden states feed
      the projector. The tower keeps all of its layers so that checkpoints convert totally and
      round-trip, but only the layers up to the deepest selected one run; later ones (and any
      post-norm or pooling head) never receive gradients.
    * ``drop_vision_class_token`` drops the first token of every image, which is what HF's
      ``vision_feature_select_strategy="default"`` does, class token or not.
    * ``pixel_shuffle`` (InternVL's, the reduction per side: 2 merges 2x2 patches) shuffles each
      image's features on its own patch grid after the class token is dropped (upstream: a
      flag for 2x2 only); ``normed_last_features`` applies the tower's final norm to its last
      layer's features, as InternVL reads ``vision_feature_layer=-1`` (the tower's output).
    * The embedding and output tables are padded past the tokenizer's vocabulary
      (``vocab_size``) for tensor parallelism. The per-token loss is taken over the real
      vocabulary only (padded logits are masked out of the softmax), so it equals HF's; returned
      logits keep the padded width, as upstream.
    * ``forward`` also takes ``media_token_counts`` (slots per placeholder; see
      :func:`_preprocess_data`), e.g. to feed a prompt in which every image row is its own
      placeholder. Tile tags, sound, virtual pipeline and context parallelism,
      packed language sequences and KV-cache inference are not implemented.
    * Pipeline parallelism splits the language model's layers, as Megatron-LM does: the vision
      tower (whole, see ``runtime.single_stage``), the projector and the embedding live on the
      first stage, the final norm and output layer on the last. Later stages keep only the
      tower's geometry (patch size, class tokens) to count each image's slots. A tied head
      under pipeline parallelism is Megatron's: the last stage's GPTModel holds its own
      ``output_layer.weight``, set from the first stage's table when built and loaded from the
      last stage's state (check hands it the table's copy, as ``convert`` writes it).
    """

    def __init__(self, language_transformer_config, language_model_builder: Callable,
                 language_vocab_size: int, vision_model: torch.nn.Module, vision_projection_config,
                 vision_projection_layer_spec: MLPSubmodules, vision_projection_input_size: int,
                 vision_projection_type: str = "mlp", parallel_output: bool = True,
                 share_embeddings_and_output_weights: bool = False,
                 image_token_index: int = DEFAULT_IMAGE_TOKEN_INDEX, *,
                 vision_feature_layers: Sequence[int] = (-1,),
                 drop_vision_class_token: bool = False, vocab_size: Optional[int] = None,
                 pixel_shuffle: int = 1, normed_last_features: bool = False):
        super().__init__(config=language_transformer_config)
        vocab_size = language_vocab_size if vocab_size is None else vocab_size
        if not 0 < vocab_size <= language_vocab_size:
            raise ValueError(f"vocab_size {vocab_size} must lie in (0, {language_vocab_size}]")
        num_vision_layers = len(vision_model.decoder.layers)
        layers = [i + num_vision_layers + 1 if i < 0 else i for i in vision_feature_layers]
        if not layers or not all(0 <= i <= num_vision_layers for i in layers):
            raise ValueError(f"vision_feature_layers {list(vision_feature_layers)} do not select "
                             f"among the {num_vision_layers + 1} hidden states of the tower")

        self.pre_process, self.post_process = runtime.is_first_stage(), runtime.is_last_stage()
        # The language-model part builds its own module (a GPTModel for the dense decoder) for a
        # padded vocabulary; rebuilt when a checkpoint was padded with another divisor.
        self._build_language_model = functools.partial(
            language_stage, language_model_builder, pre_process=self.pre_process,
            post_process=self.post_process, parallel_output=parallel_output,
            share_embeddings_and_output_weights=share_embeddings_and_output_weights)
        # Registration order is upstream's, so state dicts list the language model first.
        self.language_model = self._build_language_model(language_vocab_size)
        # What later stages need of the tower: how many slots each image fills.
        self.vision_patch_dim = vision_model.patch_dim
        self.vision_class_token_len = getattr(vision_model, "class_token_len", 0)
        merger = getattr(vision_model, "merger", None)
        self.vision_merge = merger.spatial_merge_size if merger is not None else 1
        self.vision_model = vision_model if self.pre_process else None
        self.vision_projection = MultimodalProjector(
            vision_projection_config, vision_projection_layer_spec, vision_projection_type,
            vision_projection_input_size) if self.pre_process else None
        self.share_embeddings_and_output_weights = share_embeddings_and_output_weights
        self.image_token_index = image_token_index
        self.vocab_size = vocab_size
        self.vision_feature_layers = layers
        self.drop_vision_class_token = drop_vision_class_token
        self.pixel_shuffle = pixel_shuffle
        self.normed_last_features = normed_last_features
        if pixel_shuffle > 1 and getattr(vision_model, "class_token_len", 0) and not drop_vision_class_token:
            raise ValueError("pixel shuffle needs each image's tokens to be its patch grid: drop the "
                             "class token (vision_feature_select_strategy='default')")
        self._language_max_sequence_length = language_model_builder.max_sequence_length
        tolerate_missing_extra_state(self)
        self.register_load_state_dict_pre_hook(_take_the_checkpoints_vocabulary_padding)

    # -- upstream's small API -------------------------------------------------------------------

    @property
    def decoder(self):
        return self.language_model.decoder

    def shared_embedding_or_output_weight(self):
        return self.language_model.shared_embedding_or_output_weight()

    def set_input_tensor(self, input_tensor) -> None:
        if isinstance(input_tensor, (list, tuple)):
            input_tensor = input_tensor[0]
        self.language_model.set_input_tensor(input_tensor)

    def pipelined_module(self) -> torch.nn.Module:
        """Where activations enter and leave a pipeline stage (see ``native.core.pipeline``): the
        whole GPTModel, which sizes its RoPE table from the received tensor before its block."""
        return self.language_model

    def freeze(self, freeze_language_model: bool, freeze_vision_model: bool,
               freeze_vision_projection: bool, freeze_sound_model: bool = False,
               freeze_sound_projection: bool = False, unfreeze_router: bool = False) -> None:
        """Set ``requires_grad=False`` on the chosen parts (as upstream's ``freeze``).

        This model has no sound model or projection, so those flags change nothing (upstream
        skips absent modules too). ``unfreeze_router`` keeps parameters with ``router`` in their
        name trainable inside a frozen language model (MoE routers; a dense model has none).
        """
        chosen = [(freeze_language_model, self.language_model),
                  (freeze_vision_model, self.vision_model),
                  (freeze_vision_projection, self.vision_projection)]
        for freeze, module in chosen:
            if freeze and module is not None:
                for param in module.parameters():
                    param.requires_grad = False
        if freeze_language_model and unfreeze_router:
            for name, param in self.language_model.named_parameters():
                if "router" in name.split("."):
                    param.requires_grad = True

    # -- images ----------------------------------------------------------------------------

    def vision_features(self, images: torch.Tensor, imgs_sizes=None) -> list[torch.Tensor]:
        """Selected vision hidden states per image ``[tokens_i, vision_hidden · n_layers]``.

        ``images`` is ``[num_tiles, C, H, W]`` (every tile one image of the same size) or, with
        ``imgs_sizes`` (pixels per image), pre-patchified rows ``[1, Σ patches, C·P·P]`` that run
        as one packed sequence in which each image attends only to itself.
        """
        vision = self.vision_model
        tokens, rope, seqlens = vision.embed(images, imgs_sizes)
        packed = make_packed_seq_params(seqlens, tokens.device) if seqlens is not None else None
        hidden = tokens.transpose(0, 1).contiguous()  # [s, b, h], mcore's layout
        kept = {0: hidden}
        for depth, layer in enumerate(vision.decoder.layers[: max(self.vision_feature_layers)], 1):
            hidden, _ = layer(hidden_states=hidden, attention_mask=None, rotary_pos_emb=rope,
                              packed_seq_params=packed)
            kept[depth] = hidden
        last = len(vision.decoder.layers)
        if self.normed_last_features and last in kept and getattr(vision, "ln_post", None) is not None:
            # InternVL reads its last layer as the tower's output, final norm included.
            kept[last] = vision.ln_post(kept[last])
        features = torch.cat([kept[i] for i in self.vision_feature_layers], dim=-1).transpose(0, 1)
        per_image = list(features.unbind(0)) if seqlens is None else list(features[0].split(seqlens))
        if self.drop_vision_class_token:
            per_image = [x[1:] for x in per_image]
        if self.pixel_shuffle > 1:
            # InternVL's pixel shuffle, each image (tile) on its own patch grid.
            per_image = [pixel_shuffle(x.unsqueeze(0), 1 / self.pixel_shuffle, h=h, w=w)[0]
                         for x, (h, w) in zip(per_image, self._patch_grids(images, imgs_sizes))]
        merger = getattr(vision, "merger", None)
        if merger is not None:
            # One call over every image, each merged on its own grid, as Mistral3's projector does.
            grids = self._patch_grids(images, imgs_sizes)
            merged = merger(torch.cat(per_image).unsqueeze(0), grids=grids)[0]
            per_image = list(merged.split([(h // self.vision_merge) * (w // self.vision_merge)
                                           for h, w in grids]))
        return per_image

    def encode_images(self, images: torch.Tensor, imgs_sizes=None):
        """Projected image embeddings ``[Σ tokens, language hidden]`` and tokens per image."""
        per_image = self.vision_features(images, imgs_sizes)
        rows = torch.cat(per_image).unsqueeze(1)  # [tokens, 1, h]: sequence-first like upstream
        return self.vision_projection(rows).squeeze(1), [x.shape[0] for x in per_image]

    def image_token_counts(self, images: torch.Tensor, imgs_sizes=None) -> list[int]:
        """Tokens per image that :meth:`encode_images` would return, from the shapes alone (for
        pipeline stages without the tower)."""
        m = self.vision_merge
        if m > 1:
            return [(h // m) * (w // m) for h, w in self._patch_grids(images, imgs_sizes)]
        if self.pixel_shuffle > 1:
            r = self.pixel_shuffle
            return [(h // r) * (w // r) for h, w in self._patch_grids(images, imgs_sizes)]
        dropped = 1 if self.drop_vision_class_token else 0
        return [self.vision_class_token_len + h * w - dropped
                for h, w in self._patch_grids(images, imgs_sizes)]

    def _patch_grids(self, images: torch.Tensor, imgs_sizes=None) -> list[tuple[int, int]]:
        p = self.vision_patch_dim
        if imgs_sizes is None:
            return [(images.shape[-2] // p, images.shape[-1] // p)] * images.shape[0]
        return [(int(h) // p, int(w) // p) for h, w in imgs_sizes]

    # -- forward ---------------------------------------------------------------------------

    def _slots(self, tokens_per_image, num_image_tiles):
        tiles = ([1] * len(tokens_per_image) if num_image_tiles is None
                 else [int(n) for n in torch.as_tensor(num_image_tiles).reshape(-1).tolist()])
        if sum(tiles) != len(tokens_per_image) or any(n < 1 for n in tiles):
            raise ValueError(f"num_image_tiles {tiles} do not group the {len(tokens_per_image)} "
                             "images (tiles) into placeholders")
        ends = torch.tensor(tiles).cumsum(0).tolist()
        return [sum(tokens_per_image[end - n:end]) for n, end in zip(tiles, ends)]

    def _token_loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Per-token cross entropy over the real vocabulary; ``logits`` is this rank's slice."""
        local = logits.shape[-1]
        first = parallel_state.get_tensor_model_parallel_rank() * local
        padded = torch.arange(first, first + local, device=logits.device) >= self.vocab_size
        # A fresh tensor either way: the vocab-parallel loss works in place on its input.
        logits = logits.float().masked_fill(padded, torch.finfo(torch.float32).min)
        return tensor_parallel.vocab_parallel_cross_entropy(logits, labels)

    def forward(self, images: Optional[torch.Tensor], input_ids: torch.Tensor,
                position_ids: Optional[torch.Tensor], attention_mask: Optional[torch.Tensor],
                labels: Optional[torch.Tensor] = None, loss_mask: Optional[torch.Tensor] = None,
                inference_context=None, num_image_tiles=None, image_token_index=None,
                runtime_gather_output: Optional[bool] = None, packed_seq_params=None,
                imgs_sizes=None, *, media_token_counts=None):
        """Logits ``[b, s, padded vocab]``, or ``(per-token loss [b, s], loss mask [b, s])``.

        mcore conventions (upstream's ``LLaVAModel.forward``): ``input_ids`` ``[b, t]`` with one ``image_token_index`` per
        image, ``labels`` pre-shifted, ``s`` the combined length after expanding placeholders.
        ``num_image_tiles`` groups the tiles of ``images`` into placeholders (one tile each by
        default); ``media_token_counts`` overrides the slots per placeholder.
        """
        if inference_context is not None or packed_seq_params is not None:
            raise NotImplementedError("KV-cache inference and packed language sequences are not "
                                      "implemented by this LLaVAModel")
        if image_token_index is None:
            image_token_index = self.image_token_index
        image_rows = text = None
        if images is not None and images.numel():
            if self.pre_process:
                image_rows, tokens_per_image = self.encode_images(images, imgs_sizes)
            else:
                tokens_per_image = self.image_token_counts(images, imgs_sizes)
            if media_token_counts is None:
                media_token_counts = self._slots(tokens_per_image, num_image_tiles)
        if labels is not None and loss_mask is None:
            loss_mask = torch.ones_like(labels, dtype=torch.float32)

        if self.pre_process:
            # Placeholders are no vocabulary entries: embed a stand-in, the slots are overwritten.
            text_ids = input_ids.masked_fill(input_ids == image_token_index, 0)
            text = self.language_model.embedding(input_ids=text_ids, position_ids=None).transpose(0, 1)
        combined = _preprocess_data(
            image_rows, text, input_ids, loss_mask, labels, image_token_index,
            media_token_counts=media_token_counts, position_ids=position_ids,
            language_max_sequence_length=self._language_max_sequence_length,
            pre_process=self.pre_process, post_process=self.post_process)

        logits = self.language_model(
            input_ids=None, position_ids=combined.position_ids, attention_mask=attention_mask,
            decoder_input=combined.embeddings, labels=None, runtime_gather_output=False)
        if not self.post_process:
            return logits  # this stage's hidden states, for the next stage
        if labels is not None:
            return self._token_loss(logits, combined.labels), combined.loss_mask
        gather = (not self.language_model.parallel_output if runtime_gather_output is None
                  else runtime_gather_output)
        return _gather_vocab(logits) if gather else logits


class _GatherVocab(torch.autograd.Function):
    """All-gather of the TP ranks' vocabulary slices along the last dim; backward keeps this
    rank's slice of the gradient (mcore's gather semantics). mcore's own implementation allocates
    its buffer on the current CUDA device; this one runs wherever the tensors live."""

    @staticmethod
    def forward(ctx, local, group):
        ctx.group = group
        parts = [torch.empty_like(local) for _ in range(torch.distributed.get_world_size(group))]
        torch.distributed.all_gather(parts, local.contiguous(), group=group)
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx, grad):
        world = torch.distributed.get_world_size(ctx.group)
        rank = torch.distributed.get_rank(ctx.group)
        return grad.chunk(world, dim=-1)[rank].contiguous(), None


def _gather_vocab(logits: torch.Tensor) -> torch.Tensor:
    group = parallel_state.get_tensor_model_parallel_group()
    if torch.distributed.get_world_size(group) == 1:
        return logits
    return _GatherVocab.apply(logits, group)


def build_native(cfg, params_dtype: torch.dtype = torch.float32, *, build_tower: Callable,
                 tower_packs_images: bool, tower_name: str, language) -> LLaVAModel:
    """``LLaVAModel`` from an HF ``LlavaConfig`` (the single source of truth for shapes).

    ``build_tower(vision_config, params_dtype)`` builds the vision tower's native model; a tower
    that ``packs_images`` (HF runs all images as one sequence) has no per-image first token to drop.
    ``language`` is the language-model part's native module (``transformer_config(text,
    params_dtype)``, ``LanguageModelBuilder(text, params_dtype)``).
    """
    strategy = select_strategy(cfg)
    if strategy not in ("default", "full"):
        raise ValueError(f"unknown vision_feature_select_strategy {strategy!r}")
    if strategy == "default" and tower_packs_images:
        # HF packs every image of such a tower (Pixtral) into one sequence and would drop only its
        # first patch, then fail to split the features per image.
        raise ValueError("vision_feature_select_strategy='default' drops a class token; the "
                         f"{tower_name.capitalize()} tower has none (HF's LLaVA fails on it): use 'full'")
    text = cfg.text_config
    # The tower is never split: Megatron-LM keeps it whole on the first stage. Later stages only
    # read its geometry, from a copy on the meta device that costs no memory.
    placement = contextlib.nullcontext() if runtime.is_first_stage() else torch.device("meta")
    layers = feature_layer_indices(cfg)
    # As Megatron builds it: only as deep as the deepest hidden state LLaVA reads (the converter
    # sets the layers past it aside).
    tower_config = copy.copy(cfg.vision_config)
    tower_config.num_hidden_layers = tower_depth(cfg)
    with runtime.single_stage(), placement:
        vision_model = build_tower(tower_config, params_dtype)
    shuffle = pixel_shuffle_reduction(cfg)
    return LLaVAModel(
        language_transformer_config=language.transformer_config(text, params_dtype),
        language_model_builder=language.LanguageModelBuilder(text, params_dtype),
        # Megatron-LM's padding at this TP size (what the converter writes by default).
        language_vocab_size=padded_vocab_size(text.vocab_size, VOCAB_MULTIPLE, tp=runtime.current_layout().tp),
        vision_model=vision_model,
        vision_projection_config=projection_transformer_config(cfg, params_dtype),
        # InternVL's projector norms its input first: held by linear_fc1, as Megatron-LM's.
        vision_projection_layer_spec=MLPSubmodules(
            linear_fc1=NormedColumnParallelLinear if shuffle > 1 else ColumnParallelLinear,
            linear_fc2=RowParallelLinear),
        vision_projection_input_size=cfg.vision_config.hidden_size * len(layers) * shuffle ** 2,
        share_embeddings_and_output_weights=tied_embeddings(cfg),
        vision_feature_layers=layers,
        drop_vision_class_token=strategy == "default",
        vocab_size=text.vocab_size,
        pixel_shuffle=shuffle,
        normed_last_features=shuffle > 1 and cfg.vision_feature_layer == -1,
    )
