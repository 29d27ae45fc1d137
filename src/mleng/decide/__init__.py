"""Decisions from measurements and specs: GPU upgrade economics."""
