"""Hang forensics: py-spy stacks of every rank, and flight-recorder traces compared across ranks."""
