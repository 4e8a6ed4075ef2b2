"""What a training step reduces over the SP group and how it optimises: `loss` (the whole sequence's loss from each
rank's shard, labels shifted across shards), `moe` (MoE load-balancing losses of the whole sequence), `metrics`
(torchmetrics exact over SP shards and DP ranks), `optim` (parameter groups, learning-rate schedules)."""
