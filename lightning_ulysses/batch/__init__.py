"""The batch on its way into the model: `sharding` (`SequenceSharder`: global positions, padding, this rank's cut)
and `check` (the ranks of an SP group hold one batch)."""
