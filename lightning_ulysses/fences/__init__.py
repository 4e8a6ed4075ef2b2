"""The lowest layer: each third-party library's private names, behind one accessor each, with the reason it is needed
(`_torch_private`: torch's; `_lightning_private`: Lightning's; `_deepspeed_private`: DeepSpeed's;
`_transformers_private`: transformers'), each pinned to the version it was checked on. They import nothing from the
package, so every layer may use them; nothing else in the package touches a private name of those libraries
(`tests/unit/test_layers.py` parses every module for one; `test_torch_private.py`, `test_lightning_private.py`,
`test_deepspeed_private.py`, `test_transformers_private.py`, `test_pretrained.py` check the fenced names still exist)."""
