"""The models: loading them (loading), running them over token batches (forwards), which model plays which role (roles), LoRA adapters, the compiled forward."""
