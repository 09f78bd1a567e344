"""Scoring completions (reward functions) and comparing models (win rates)."""
