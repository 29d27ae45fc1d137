"""Will it fit, and is it communication-bound: memory and communication estimated from the architecture."""
