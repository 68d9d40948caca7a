"""The models: loading them and running them over token batches (loading), which model plays which role (roles), LoRA adapters, the compiled forward."""
