"""How the ranks of a run are arranged, and the run described once: `layout` (the SP × DP arithmetic, the process
groups, DeepSpeed's mpu, the shard order), `run_spec` (`RunSpec`: layout, ZeRO stage and options, precision,
device, offload, read from the strategy's arguments and the DeepSpeed config), `views` (recognising a tensor or its
unmodified alias in metadata only). Everything above reads the run from here."""
