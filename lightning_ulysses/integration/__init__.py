"""Where the package meets Lightning and DeepSpeed: `strategy` (`UlyssesDeepSpeedStrategy`, Lightning's hooks, each
delegating), `preparation` (the module pipeline), `engine` (the DeepSpeed engine of a run), `checkpoint` (atomic saves,
exact resumes, export from a checkpoint), `export` (`ExportPretrained`), `pretrained` (ZeRO-3 loading), `faults`,
`rng`, `notebook`, `callbacks`, `console`, and `inference` (predict outputs, serving)."""
