"""Checks -> findings (severity, evidence, handbook ids): what is wrong with this machine or job."""
