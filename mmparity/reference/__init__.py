"""The HF side: per family, its tiny config, the family config inside a whole-model config, the
shapes of its state dict (``state_shapes``) and the transformers model (``build``).

Importing a family module loads nothing of transformers: its configuration classes are imported
where a config is built (``tiny_config``, ``published_config``), the model class inside ``build``.
``mmparity convert`` reads the family config and the shapes from here off a
:class:`mmparity.hfconfig.ConfigView`, so it never imports transformers, whose import alone costs
more CPU than the rest of a small conversion does.
"""
