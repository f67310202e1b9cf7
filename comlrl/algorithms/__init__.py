"""The maths of the trainers as pure tensor functions (no trainer state)."""
