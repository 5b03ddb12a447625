"""Throwaway families the tests register: a tower, a language-model part with experts, and a
whole VLM composed of a registered tower and that part. Each is one package, registered by one
line (``MMPARITY_FAMILIES`` for a command, ``registry.register`` in one process); nothing outside
its package names it."""
