"""Prompts in SmolLM2's chat format (ChatML), shared by the bundled tasks' formatters."""

from __future__ import annotations


def chat_prompt(instruction: str, passage: str) -> str:
    """One user turn (an instruction, a blank line, the passage) and the start of the assistant's."""
    return f"<|im_start|>user\n{instruction}\n\n{passage}<|im_end|>\n<|im_start|>assistant\n"
