"""Async RL for LLMs."""
