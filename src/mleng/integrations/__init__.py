"""Callbacks that bring mleng into a training framework's own loop: the preflight at train start, the crash hook.

    from mleng.integrations.hf import MlengCallback          # pip install 'mleng[hf]'
    from mleng.integrations.lightning import MlengCallback   # pip install 'mleng[lightning]'

Each framework is an optional extra: `import mleng` (and this package) imports neither of them, and importing
a callback module without its framework installed raises one ImportError that names the extra to install.
"""
