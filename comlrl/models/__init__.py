"""Training entities: loading agents and critics with their tokenizers, value heads, the joint reward model, LoRA, export."""
