"""The environment fingerprint of the machine a measurement ran on (see mleng.machine.fingerprint)."""
