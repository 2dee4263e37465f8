"""Integrations with serving engines (each imports its engine inside its own package only)."""
