"""Integrations of DualPath into serving stacks (vLLM). Nothing here is imported by the rest of the package."""
