"""The HF side: per family, its tiny config, the family config inside a whole-model config, the
shapes of its state dict (``state_shapes``) and the transformers model (``build``).

Importing a family module loads transformers' configuration classes only; the model class is
imported inside ``build``. ``mmparity convert`` reads the config and the shapes from here and so
never loads transformers' modeling code, which costs several times what the rest of a small
conversion does.
"""
