"""Hydra and Megatron-core integrations."""
