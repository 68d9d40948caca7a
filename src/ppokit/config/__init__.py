"""The configuration: the schema of every section (schema: ppo's; stages: sft's, rm's and the pipeline's), the generic
dataclass machinery (fields), the generated reference docs/config.md (reference), and TRL's GRPO names."""
