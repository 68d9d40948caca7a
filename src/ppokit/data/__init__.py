"""Training data: reading sources (files, saved datasets), the formats each stage accepts (formats), PPO's prompts, and the length rule."""
