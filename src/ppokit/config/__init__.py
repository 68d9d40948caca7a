"""The configuration: the schema of every section (schema), the generic dataclass machinery (fields), the generated reference docs/config.md (reference), and
TRL's GRPO names."""
