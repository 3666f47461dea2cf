"""Cost and wall-time estimate of a run before anything is sent (`eagle3-datagen estimate`, the `dry_run` flow
parameter, and the check `run` makes before its first paid request): `estimate.estimate_run`, `display`,
`prices`. Kept import-free here so `errors` loads without the tokenizer stack."""
