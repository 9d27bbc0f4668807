"""The frameworks' integrations, each an extra: Hydra (hydra.py), Megatron-core (megatron.py),
Lightning (lightning.py), Hugging Face's Trainer (transformers.py), Ray (ray.py); _steps.py holds
what the framework callbacks share (FetchWait: the data wait in DataLoader fetches)."""
