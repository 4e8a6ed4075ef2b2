"""The lowest layer: each third-party library's private names, behind one accessor each, with the reason it is needed
(`_lightning_private`: Lightning's; `_deepspeed_private`: DeepSpeed's; `_transformers_private`: transformers'). They
import nothing from the package, so every layer may use them; nothing else in the package touches those names
(`tests/unit/test_layers.py`, `test_lightning_private.py`, `test_deepspeed_private.py`, `test_pretrained.py`)."""
