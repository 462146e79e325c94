"""Evaluation harness: benchmarks, prompts, graders, result store."""
