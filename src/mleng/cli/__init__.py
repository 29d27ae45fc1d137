"""Thin commands: parse, call the library, render."""
