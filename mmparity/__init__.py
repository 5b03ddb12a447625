"""mmparity: parity testing and checkpoint conversion for multimodal vision encoders."""

__version__ = "0.1.0"
