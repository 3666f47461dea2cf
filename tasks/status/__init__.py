"""What a run directory holds, stage by stage, and what a rerun would rebuild: `plan` decides per part,
`report` reconciles sample ids across stages for `eagle3-datagen status` and the run's artifact."""
