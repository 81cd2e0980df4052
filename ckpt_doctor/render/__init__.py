"""Renderers: every output format is drawn from the same result object, so table and JSON never disagree."""
