"""The validate stage: per-sample checks on the reconstructed ids, per-dataset summaries, gates, report and plots."""
